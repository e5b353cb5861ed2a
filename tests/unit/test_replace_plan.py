"""Replacing a live server: the plan diff an operator decides on (built from the real lab and spark-duo params),
the refusal without confirm_replace, the API key's params rules and header, and the client addresses per network."""
from __future__ import annotations

from pathlib import Path

import pytest

from sparkbook.core.cluster.context import Context
from sparkbook.core.values.errors import SparkbookError
from sparkbook.core.values.params import Params, ParamsError, bearer, load_params
from sparkbook.stages.serve import commands, endpoints, replace
from sparkbook.stages.serve.commands import ServeError
from sparkbook.stages.serve.plandiff import differences
from sparkbook.stages.serve.reuse import Serving, plan_data

PARAMS = Path(__file__).resolve().parents[2] / "params"


def real(tmp_path: Path, name: str, overrides: dict[str, object] | None = None) -> Params:
    """A committed params file as is (its key files commented out: they may not exist where unit tests run)."""
    text = (PARAMS / name).read_text()
    for key in ("key_file", "known_hosts"):
        text = text.replace(f"  {key}:", f"  # {key}:")
    path = tmp_path / name
    path.write_text(text)
    return load_params(path, overrides)


def lab_plan(tmp_path: Path, overrides: dict[str, object] | None = None) -> commands.ServePlan:
    """The lab's plan for the mp executor, with serve settings overridden as `-p`-style dotted keys."""
    params = real(tmp_path, "lab.yaml", {f"serve.{k}": v for k, v in (overrides or {}).items()})
    return commands.plan(Context(params, None, None, tmp_path, image="img"), "mp")  # type: ignore[arg-type]


def test_the_same_plan_has_no_differences(tmp_path):
    assert differences(plan_data(lab_plan(tmp_path)), plan_data(lab_plan(tmp_path))) == []


def test_the_smoke_tests_question_is_not_the_servers_plan(tmp_path):
    """serve.smoke shapes 05's requests, not the server: a changed question replaces nothing, and the recorded
    plan keeps it (a reused or rolled-back server's own record must not fall back to the defaults)."""
    asked = lab_plan(tmp_path, {"smoke.expect": "Paris"})
    assert differences(plan_data(lab_plan(tmp_path)), plan_data(asked)) == []
    assert plan_data(lab_plan(tmp_path))["settings"]["smoke"]["expect"] is None  # the lab's own opt-out, recorded


def test_a_server_recorded_before_a_settings_field_existed_is_the_same_plan_at_its_default(tmp_path):
    """A live server a sparkbook before serve.layout / replica_port / router_policy recorded lacks them: at their
    defaults they change nothing it does (no replacement asked for on an upgrade); set otherwise, they are named."""
    older = plan_data(lab_plan(tmp_path))
    for field in ("layout", "replica_port", "router_policy"):
        del older["settings"][field]
    assert differences(older, plan_data(lab_plan(tmp_path))) == []
    changed = differences(older, plan_data(lab_plan(tmp_path, {"router_policy": "round_robin"})))
    assert [(d.field, d.running, d.new) for d in changed] == [("serve.router_policy", "", "round_robin")]


def test_a_changed_setting_shows_the_field_and_each_nodes_argv(tmp_path):
    changed = differences(plan_data(lab_plan(tmp_path)), plan_data(lab_plan(tmp_path, {"max_num_seqs": 8})))
    rows = {(d.field, d.running, d.new) for d in changed}
    assert ("serve.max_num_seqs", "16", "8") in rows
    assert ("commands[lab-0].argv", "16", "8") in rows
    assert ("commands[lab-1].argv", "16", "8") in rows
    assert len(changed) == 3, changed  # nothing else differs: the rest of the argv is equal


def test_a_planted_argument_and_an_env_change_are_named(tmp_path):
    before = lab_plan(tmp_path)
    extra = [*before.settings.extra_args, "--planted-unknown-flag"]
    after = lab_plan(tmp_path, {"extra_args": extra, "node_env.lab-0.VLLM_CPU_OMP_THREADS_BIND": "0-1"})
    rows = {(d.field, d.running, d.new) for d in differences(plan_data(before), plan_data(after))}
    assert ("commands[lab-0].argv", "", "--planted-unknown-flag") in rows
    assert ("commands[lab-0].env.VLLM_CPU_OMP_THREADS_BIND", "0", "0-1") in rows
    assert any(f == "serve.extra_args" and "--planted-unknown-flag" in new for f, _, new in rows)
    assert not any(f == "commands[lab-1].env.VLLM_CPU_OMP_THREADS_BIND" for f, _, _ in rows)


def replacement(tmp_path: Path) -> replace.Replacement:
    running = lab_plan(tmp_path)
    serving = Serving(plan_data(running), running, 1, 1, 41.5, "20261201T195946Z", "2026-12-01T19:59:46Z")
    new = lab_plan(tmp_path, {"max_num_seqs": 4})
    return replace.Replacement(serving, differences(serving.requested, plan_data(new)))


def test_without_confirmation_05_stops_naming_the_server_and_the_differences(tmp_path):
    r = replacement(tmp_path)
    with pytest.raises(ServeError) as exc:
        replace.confirm(r, confirm_replace=False)
    text = str(exc.value)
    assert "run 20261201T195946Z's server" in text and "left untouched" in text
    assert "serve.max_num_seqs: '16' -> '4'" in text and "confirm_replace=true" in text
    replace.confirm(r, confirm_replace=True)  # confirmed: no error
    replace.confirm(None, confirm_replace=False)  # nothing live to replace: no error
    assert r.decision().key == "replace" and r.event()["run"] == "20261201T195946Z"


def test_the_api_key_variable_must_be_a_listed_secret(write_params, base):
    base["serve"]["api_key_env"] = "VLLM_API_KEY"
    with pytest.raises(ParamsError) as exc:
        load_params(write_params(base))
    assert [p.field for p in exc.value.problems] == ["serve.api_key_env"]
    assert "secrets" in exc.value.problems[0].message
    base["secrets"].append("VLLM_API_KEY")
    assert load_params(write_params(base)).serve.api_key_env == "VLLM_API_KEY"


def test_the_bearer_header_reads_the_variable_where_the_request_is_sent(monkeypatch):
    assert bearer(None) == {}
    monkeypatch.delenv("SPARKBOOK_TEST_KEY", raising=False)
    with pytest.raises(SparkbookError, match="SPARKBOOK_TEST_KEY is not set"):
        bearer("SPARKBOOK_TEST_KEY")
    monkeypatch.setenv("SPARKBOOK_TEST_KEY", "k-123")
    assert bearer("SPARKBOOK_TEST_KEY") == {"Authorization": "Bearer k-123"}


def test_the_lab_has_one_network_and_no_warning(tmp_path):
    lab = real(tmp_path, "lab.yaml")
    assert [a.row() for a in endpoints.client_addresses(lab)] == [
        {"network": "management and fabric", "URL": "http://10.77.0.10:8000", "answers": "yes"}]
    assert endpoints.listen_warning(lab) is None


def test_spark_duo_lists_both_networks_and_warns_on_every_interface(tmp_path):
    duo = real(tmp_path, "spark-duo.yaml")
    port = duo.serve.port
    assert [(a.network, a.url, a.not_listening) for a in endpoints.client_addresses(duo)] == [
        ("management", f"http://10.1.230.180:{port}", None), ("fabric", f"http://192.168.200.12:{port}", None)]
    warning = endpoints.listen_warning(duo)
    assert warning is not None and "10.1.230.180" in warning and "192.168.200.12" in warning
    assert "/invocations asks no key" in warning  # a key does not close a server's own port (measured on the lab)
    fabric_only = real(tmp_path, "spark-duo.yaml", {"serve.host": "192.168.200.12"})
    assert endpoints.listen_warning(fabric_only) is None
    assert [a.not_listening for a in endpoints.client_addresses(fabric_only)] == ["no: serve.host is 192.168.200.12",
                                                                                  None]


def test_a_failed_rollback_is_reported_as_such_with_both_causes(tmp_path):
    from sparkbook.stages.serve.launch import Launch, Readiness
    from sparkbook.stages.serve.rollback import Rollback

    old = lab_plan(tmp_path)
    launched = Launch(old, 1, {}, 0.0)
    dead = Readiness(False, 12.0, None, [], {"lab-0": "RuntimeError: Engine core initialization failed"})
    failed = Rollback("20261201T195946Z", "serving did not start (1 attempt(s)): unknown argument", launched, dead,
                      [], 75.4, "lab-0: the process exited")
    assert not failed.ok and failed.decision().choice == "nothing: the rollback failed too"
    assert "rollback to run 20261201T195946Z failed as well (lab-0: the process exited)" in failed.summary()
    assert "the new plan failed: serving did not start" in failed.summary()
    assert failed.log_tails() == {"serve-lab-0-rollback.log": "RuntimeError: Engine core initialization failed"}
    ok = Rollback("20261201T195946Z", "unknown argument", launched, dead, [], 75.4, None)
    assert ok.summary().startswith("rolled back to run 20261201T195946Z: its plan serves again after 75 s")
    assert ok.event()["seconds_without_service"] == 75.4


def test_check_warns_on_every_interface_with_a_management_network_and_still_passes(tmp_path, capsys):
    from sparkbook import cli

    text = (PARAMS / "spark-duo.yaml").read_text()
    for key in ("key_file", "known_hosts"):
        text = text.replace(f"  {key}:", f"  # {key}:")
    (tmp_path / "duo.yaml").write_text(text)
    assert cli.main(["check", str(tmp_path / "duo.yaml")]) == 0
    err = capsys.readouterr().err
    assert err.startswith("warning: serve.host: 0.0.0.0") and "management address 10.1.230.180" in err
