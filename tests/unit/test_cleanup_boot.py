"""Cleanup disables the enabled units it stops and restore enables them again: the commands chosen from systemd's
UnitFileState, and systemctl's report of the boot links it changed, read from real recorded output."""
from __future__ import annotations

from pathlib import Path

from sparkbook.core.analysis.hostfacts import Memory
from sparkbook.core.values.params import CleanupTargets
from sparkbook.stages.cleanup import boot
from sparkbook.stages.cleanup.inventory import Inventory, Unit
from sparkbook.stages.cleanup.ownership import SHOW_PROPERTIES, parse_show
from sparkbook.stages.cleanup.planning import plan

DATA = Path(__file__).parent / "data"


def transcripts() -> dict[str, str]:
    """The recorded file's sections: title -> systemctl's output."""
    out: dict[str, str] = {}
    title = ""
    for line in (DATA / "systemctl_enable_disable.txt").read_text().splitlines():
        if line.startswith("#"):
            continue
        if line.startswith("== "):
            title = line.strip("= ")
            out[title] = ""
        else:
            out[title] += line + "\n"
    return out


def test_disable_reports_the_removed_boot_link_in_both_quotings() -> None:
    t = transcripts()
    now = boot.links(t["disable --now (Ubuntu server, a lab unit)"])
    assert now.removed == ["/etc/systemd/system/multi-user.target.wants/monitor-disk.service"] and not now.created
    sysv = boot.links(t["disable (Debian, a unit with a SysV script)"])
    assert sysv.removed == ["/etc/systemd/system/multi-user.target.wants/apache2.service"], "SysV lines ignored"
    assert boot.links('Removed /etc/systemd/system/multi-user.target.wants/x.service.').removed == \
        ["/etc/systemd/system/multi-user.target.wants/x.service"], "before systemd 253: unquoted"


def test_enable_reports_each_created_link_old_and_new_forms() -> None:
    t = transcripts()
    wants = "/etc/systemd/system/multi-user.target.wants/kube-controller-manager.service"
    assert boot.links(t["enable --now (a binary Kubernetes install)"]).created == [wants]
    assert boot.links(t["enable --now (the same install on CentOS 7, systemd 219)"]).created == [wants]
    two = boot.links(t["enable (rpcbind's package scriptlet: a service and its socket)"])
    assert two.created == ["/etc/systemd/system/multi-user.target.wants/rpcbind.service",
                           "/etc/systemd/system/sockets.target.wants/rpcbind.socket"]
    assert "linked /etc/systemd/system/sockets.target.wants/rpcbind.socket" in two.describe()
    nothing = boot.links(t["disable of a unit that was not enabled (systemd 232: nothing printed)"])
    assert nothing.describe() == "no boot link changed"


def test_unit_file_state_is_asked_and_read() -> None:
    assert "UnitFileState" in SHOW_PROPERTIES.split(",")
    assert parse_show("Id=vllm-cluster.service\nActiveState=active\nUnitFileState=enabled\n").file_state == "enabled"


def test_plan_disables_enabled_units_and_restore_enables_them_again() -> None:
    units = [Unit("vllm-cluster.service", "active", [], file_state="enabled"),
             Unit("vllm-proxy.service", "active", [], file_state="disabled"),
             Unit("vllm-static.service", "active", [], file_state="static")]
    head = Inventory("spark-1a32", [], "Docker 28", units, "systemd", [], "no GPU", [], Memory(100 << 30, 10 << 30))
    by_name = {t.name: t for t in plan([head], CleanupTargets(systemd_units=["vllm-*.service"])).targets}
    assert by_name["vllm-cluster.service"].stop == "systemctl disable --now -- vllm-cluster.service"
    assert by_name["vllm-cluster.service"].restore == "systemctl enable --now -- vllm-cluster.service"
    for name in ("vllm-proxy.service", "vllm-static.service"):  # they did not start at boot: left as they were
        assert by_name[name].stop == f"systemctl stop -- {name}" and by_name[name].restore == f"systemctl start -- {name}"
