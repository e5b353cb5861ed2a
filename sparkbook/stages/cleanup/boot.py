"""Whether a stopped unit comes back at boot: cleanup disables the enabled units it stops (`systemctl disable
--now`), so a reboot does not start the old deployment beside the new one, and restore enables them again."""
from __future__ import annotations

import re
import shlex
from dataclasses import dataclass

ENABLED = "enabled"  # UnitFileState of a unit whose [Install] links exist (it starts at boot)
_CREATED = re.compile(r'^Created symlink (?:from )?"?(\S+?)"? (?:→|->|to) "?(\S+?)"?\.?$')
_REMOVED = re.compile(r'^Removed (?:symlink )?"?(\S+?)"?\.?$')


@dataclass(frozen=True)
class Links:
    """The symlinks `systemctl enable`/`disable` reported changing (what makes a unit start at boot)."""

    created: list[str]
    removed: list[str]

    def describe(self) -> str:
        made = [f"linked {p}" for p in self.created] + [f"unlinked {p}" for p in self.removed]
        return "; ".join(made) or "no boot link changed"


def links(output: str) -> Links:
    """systemctl's report of an enable or disable (it prints on stderr), in the forms systemd has used: `Created
    symlink A → B.` (ASCII `->`; systemd 219: `Created symlink from A to B.`), `Removed "A".` (before v253:
    `Removed A.`; systemd 219: `Removed symlink A.`). Other lines (SysV sync) are ignored."""
    created, removed = [], []
    for line in output.splitlines():
        if m := _CREATED.match(line.strip()):
            created.append(m.group(1))
        elif m := _REMOVED.match(line.strip()):
            removed.append(m.group(1))
    return Links(created, removed)


def stop_command(unit: str, file_state: str) -> str:
    """Stopping an enabled unit also disables it: it would start again at the next boot. The unit is quoted: its
    name may carry systemd's escapes (`vllm@model\\x2dname.service`), whose backslash a shell or shlex.split drops;
    and it follows `--`, so a name that starts with `-` is never read as an option (`-Hroot@host.service` would send
    the command to another machine)."""
    verb = ["disable", "--now"] if file_state == ENABLED else ["stop"]
    return shlex.join(["systemctl", *verb, "--", unit])


def start_command(unit: str, file_state: str) -> str:
    """Bring it back as it was: an enabled unit enabled again (and started), any other only started (quoted as
    stop_command's)."""
    verb = ["enable", "--now"] if file_state == ENABLED else ["start"]
    return shlex.join(["systemctl", *verb, "--", unit])
