"""The runbook's own directory on each node (node state): its PID files, the Python runtime's places and logs, 03's
rsync PID files and the run lock. The runbook acts as root on the nodes, so a directory anyone else could have made
or could still change would let them point its writes at root's files (symlinks) or its signals at root's processes
(PID files): `ensure` resolves it on the node (NodeSpec.state_dir, else ~/.sparkbook/NODE of the SSH user), creates
it with mode 0700 (umask 077) and refuses it unless this SSH user owns it alone, below parents no one else can change.

    ensure(node) -> str                    the state dir's physical path (checked once per Node), or NodeStateError
    judge(lines, uid, node, path) -> str   the physical path, or NodeStateError: the pure decision over the walk
    pid_record_sh(f) / IDENTITY_SH         write a session leader's identity / check it before signalling it
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

from ..values.errors import SparkbookError
from .nodes import Node

DEFAULT_ROOT = ".sparkbook"  # in the SSH user's home: DEFAULT_ROOT/NODE (lab nodes share /root: NODE tells them apart)
TIMEOUT_S = 30
LOCK = "run.lock"  # the run lock's directory, in the head's state dir
_OTHERS_WRITE, _STICKY = 0o022, 0o1000

# Walk "$0" (or ~/.sparkbook/"$1") from / down, one line per component: "KIND UID MODE PATH" (KIND: d a directory,
# l a symlink, o anything else), a symlink followed physically; a missing component is created (umask 077) only
# below components that passed, so nothing is made under a directory someone else controls. Last line: "me UID".
WALK_SH = r"""
d=${0:-"$HOME/.sparkbook/$1"}; me=$(id -u); umask 077; set -f
case $d in /*) ;; *) echo "me $me"; exit 0;; esac
ok() { [ "$1" = 0 ] || [ "$1" = "$me" ] || return 1
       [ $(( 0$2 & 022 )) = 0 ] || { [ "$1" = 0 ] && [ $(( 0$2 & 01000 )) != 0 ]; }; }
p=; IFS=/; set -- ${d#/}; IFS=' '
for c; do
  [ -z "$c" ] && continue
  n="$p/$c"
  if [ -L "$n" ]; then
    set -- $(stat -c '%u %a' "$n"); echo "l $1 $2 $n"; ok "$1" 0 || break
    n=$(cd -P -- "$n" 2>/dev/null && pwd) || { echo "o - - $p/$c"; break; }
  fi
  [ -e "$n" ] || mkdir -- "$n" 2>/dev/null
  if [ -d "$n" ] && [ ! -L "$n" ]; then k=d; else k=o; fi
  set -- $(stat -c '%u %a' "$n" 2>/dev/null || echo - -); echo "$k $1 $2 $n"
  [ $k = d ] && ok "$1" "$2" || break
  p=$n
done
echo "me $me"
"""

# The fields of /proc/PID/stat after the command name (the text after its last ")", which a name cannot fake):
# " STATE PPID PGRP SESSION ...", so cut's field N is stat's field N+1: 5 the session, 21 the start time.
# A PID file, as the shell that execs the session leader writes it: "PID START" of itself ($$), any link or file there
# removed first and the file created exclusively (noclobber: O_EXCL, so a symlink planted meanwhile is not followed).
def pid_record_sh(pid_file: str) -> str:
    """The shell lines writing `pid_file` (a shell word, e.g. '"$0.pid"'); no single quote, so they nest in one."""
    return (f'rm -f {pid_file}; s=$(cat /proc/$$/stat); ( set -C; echo "$$ $(echo "${{s##*\\)}}" | cut -d" " -f21)" '
            f'>{pid_file} ) 2>/dev/null || exit 97')


# "$0": a PID file as pid_record_sh writes it. Exit 0 with the PID in $p (and its stat fields in $s) once its process
# is the one recorded: no symlink, a PID above 1, the same start time, the leader of its own session. Else exit
# REFUSED saying why on stderr, or GONE where there is nothing to signal (no record, or its process ended).
IDENTITY_SH = ('[ ! -L "$0" ] || { echo "$0 is a symbolic link: refused" >&2; exit 3; }; '
               'read -r p t _ <"$0" 2>/dev/null || exit 4; '
               'case "$p.$t" in *[!0-9.]*|.*|*.) echo "$0 holds no PID record: refused" >&2; exit 3;; esac; '
               '[ "$p" -gt 1 ] || { echo "$0 names pid $p: refused" >&2; exit 3; }; '
               's=$(cat /proc/$p/stat 2>/dev/null) || exit 4; s=${s##*\\)}; '
               '[ "$(echo "$s" | cut -d" " -f21)" = "$t" ] && [ "$(echo "$s" | cut -d" " -f5)" = "$p" ] || '
               '{ echo "pid $p is not the process $0 recorded (start time or session differs): that one has ended, '
               'this one is not signalled" >&2; exit 4; }')

REFUSED, GONE = 3, 4

_checked: weakref.WeakKeyDictionary[Node, str] = weakref.WeakKeyDictionary()


class NodeStateError(SparkbookError):
    """A node's state dir is not the runbook's own: someone else owns it or can change it (or a parent)."""

    exit_kind = "invalid"
    label = "refused"


@dataclass(frozen=True)
class Step:
    """One component of the walk: what it is (d, l, o), its owner and mode, its path."""

    kind: str
    uid: int | None
    mode: int | None
    path: str


def lock_path(head: Node) -> str:
    """Where the run lock lives: in the head's state dir, the runbook's own."""
    return f"{ensure(head)}/{LOCK}"


def ensure(node: Node) -> str:
    """The node's state dir, created and checked on the node the first time this Node asks."""
    if node in _checked:
        return _checked[node]
    r = node.run(["sh", "-c", WALK_SH, node.spec.state_dir or "", node.name], timeout=TIMEOUT_S)
    wanted = node.spec.state_dir or f"~/{DEFAULT_ROOT}/{node.name}"
    lines = r.stdout.splitlines()
    if not r.ok or not lines or not lines[-1].startswith("me "):
        raise NodeStateError(f"{node.name}: cannot walk its state dir {wanted}: "
                             f"{(r.stderr or r.stdout).strip()[-200:] or 'no answer'}", node=node.name)
    path = judge(lines[:-1], int(lines[-1].split()[1]), node.name, wanted)
    _checked[node] = path
    return path


def parse(line: str) -> Step:
    kind, uid, mode, path = line.split(" ", 3)
    return Step(kind, int(uid) if uid.isdigit() else None, int(mode, 8) if mode.isdigit() else None, path)


def judge(lines: list[str], me: int, node: str, wanted: str) -> str:
    """The state dir's physical path when every parent is root's or this user's and no one else can change it (a
    root-owned sticky directory such as /tmp counts as safe: no one else can rename or remove what this user made
    there, and what they made first is theirs, refused below) and the dir itself is this user's alone; else
    NodeStateError naming the node, the path and what is wrong."""
    steps = [parse(line) for line in lines]
    if not steps:
        raise _refuse(node, wanted, "it is not an absolute path (is the SSH user's HOME set?)")
    for s in steps[:-1]:
        if why := _parent_wrong(s, me):
            raise _refuse(node, wanted, f"its parent {s.path} {why}")
    last = steps[-1]
    if last.kind != "d" or last.uid is None or last.mode is None:
        raise _refuse(node, wanted, f"{last.path} is {'a symbolic link' if last.kind == 'l' else 'not a directory'}"
                      + ("" if last.kind != "l" or _owner_ok(last.uid, me) else f" owned by uid {last.uid}"))
    if last.uid != me:
        raise _refuse(node, wanted, f"{last.path} is owned by uid {last.uid}, not by the SSH user (uid {me})")
    if last.mode & _OTHERS_WRITE:
        raise _refuse(node, wanted, f"{last.path} has mode {last.mode:o}: others can write in it")
    return last.path


def _owner_ok(uid: int | None, me: int) -> bool:
    return uid in (0, me)


def _parent_wrong(s: Step, me: int) -> str | None:
    """Why a parent on the way lets someone else change what lies below it; None where it does not."""
    if not _owner_ok(s.uid, me):
        return f"is owned by uid {s.uid}, neither root nor the SSH user (uid {me})"
    if s.kind == "l":
        return None  # a link of root's or ours: its target is the next step, checked there
    if s.kind != "d" or s.mode is None:
        return "is not a directory"
    if s.mode & _OTHERS_WRITE and not (s.uid == 0 and s.mode & _STICKY):
        return f"has mode {s.mode:o}: others can write in it"
    return None


def _refuse(node: str, wanted: str, why: str) -> NodeStateError:
    return NodeStateError(f"{node}: state dir {wanted}: {why}; it is left as it is", node=node,
                          remediation=f"remove it by hand on {node}, or set the node's state_dir to a directory of "
                          "the SSH user's own below parents only root and that user can write")
