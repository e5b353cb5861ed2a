"""What 03 moves, without a cluster: the model-copy plan from two listings, the HF blob verification, the disk
check, the stream split; the image layers a node already holds (chain IDs, Docker's v1 IDs, a filtered save
stream that keeps every other member byte for byte)."""
from __future__ import annotations

import hashlib
import io
import json
import tarfile

import pytest

from sparkbook.stages.images import layerdelta, modelcopy
from sparkbook.stages.images.modelcopy import Entry, Listing

BLOB = "a" * 64
REV = "1" * 40
HEAD_FILES = (f"==free==\n500000000000\n==root==\nyes\n==ref==\n{REV}\n==files==\n"
              f"f\t40\trefs/main\t\n"
              f"f\t1000\tblobs/{BLOB}\t\n"
              f"f\t20\tblobs/0123456789abcdef0123456789abcdef01234567\t\n"
              f"l\t76\tsnapshots/{REV}/model.safetensors\t../../blobs/{BLOB}\n"
              f"l\t52\tsnapshots/{REV}/config.json\t../../blobs/0123456789abcdef0123456789abcdef01234567\n"
              f"f\t5\tblobs/stale-old-revision\t\n"
              f"==staged==\n==end==\n")
ROOT = "/cache/hub/models--org--m"


def hf_listing(node: str, text: str) -> Listing:
    return modelcopy.parse_listing(node, ROOT, "hf", text)


def test_listing_parses_files_links_staged_and_free_space() -> None:
    lst = hf_listing("h", HEAD_FILES)
    assert lst.exists and lst.free_bytes == 500_000_000_000 and not lst.staged and lst.ref == REV
    assert lst.entries[f"snapshots/{REV}/model.safetensors"] == Entry(f"snapshots/{REV}/model.safetensors", "l", 76,
                                                                      f"../../blobs/{BLOB}")
    assert lst.stage == "/cache/hub/.models--org--m.sparkbook-incoming"


def test_wanted_is_the_ref_snapshot_and_its_blobs_only() -> None:
    want = modelcopy.wanted(hf_listing("h", HEAD_FILES))
    assert sorted(want) == ["blobs/0123456789abcdef0123456789abcdef01234567", f"blobs/{BLOB}", "refs/main",
                            f"snapshots/{REV}/config.json", f"snapshots/{REV}/model.safetensors"]
    broken = HEAD_FILES.replace(f"f\t1000\tblobs/{BLOB}\t\n", "")
    assert modelcopy.wanted(hf_listing("h", broken)) == {}, "a snapshot link to a missing blob is no source"
    escaping = HEAD_FILES.replace(f"../../blobs/{BLOB}", f"../../../../blobs/{BLOB}")
    assert modelcopy.wanted(hf_listing("h", escaping)) == {}, "a link out of the repo is no source"
    only_ref = "".join(line + "\n" for line in HEAD_FILES.splitlines() if "snapshots/" not in line)
    assert modelcopy.wanted(hf_listing("h", only_ref)) == {}, "refs/main without its snapshot is no source"


def test_plan_copies_what_the_worker_lacks_or_holds_with_another_size() -> None:
    worker = ("==free==\n9000000\n==root==\nyes\n==files==\n"
              f"f\t999\tblobs/{BLOB}\t\n"  # a partial blob (another size): sent again
              "f\t20\tblobs/0123456789abcdef0123456789abcdef01234567\t\n"
              f"==staged==\nf\t1000\tblobs/{BLOB}\t\n==end==\n")  # ... but a finished copy is already staged
    p = modelcopy.plan({"h": hf_listing("h", HEAD_FILES), "w": hf_listing("w", worker)}, "h")
    assert p.source == "h" and p.complete == [] and len(p.nodes) == 1
    need = p.nodes[0]
    assert [e.path for e in need.entries] == [f"blobs/{BLOB}", "refs/main", f"snapshots/{REV}/config.json",
                                              f"snapshots/{REV}/model.safetensors"]
    assert need.bytes_to_send == 40, "the staged, complete blob is not counted again (only refs/main is left)"


def test_plan_takes_another_node_as_source_when_the_head_lacks_the_model() -> None:
    empty = "==free==\n100\n==root==\n==files==\n==staged==\n==end==\n"
    p = modelcopy.plan({"h": hf_listing("h", empty), "w": hf_listing("w", HEAD_FILES)}, "h")
    assert p.source == "w" and [n.node for n in p.nodes] == ["h"]
    with pytest.raises(modelcopy.ModelCopyError, match="no node holds a complete copy"):
        modelcopy.plan({"h": hf_listing("h", empty)}, "h")


def test_plan_for_a_plain_dir_and_a_node_that_matches() -> None:
    files = ("==free==\n100\n==root==\nyes\n==files==\nf\t10\tconfig.json\t\nf\t300\tw/model.safetensors\t\n"
             "==staged==\n==end==\n")
    same = modelcopy.parse_listing("w", "/srv/m", "dir", files)
    p = modelcopy.plan({"h": modelcopy.parse_listing("h", "/srv/m", "dir", files), "w": same}, "h")
    assert p.nodes == [] and p.complete == ["w"] and p.total_bytes == 310


def test_disk_check_names_node_path_and_sizes_before_copying() -> None:
    p = modelcopy.NodePlan("lab-1", ROOT, [], bytes_to_send=3_000_000_000, free_bytes=2_000_000_000)
    with pytest.raises(modelcopy.DiskTooSmall) as err:
        modelcopy.check_disk(p, reserve_bytes=modelcopy.size_bytes("1G"))
    text = str(err.value)
    assert text.startswith(f"lab-1: {ROOT}: the disk has 2.00 GB free") and "3.00 GB more" in text
    assert err.value.node == "lab-1"
    modelcopy.check_disk(modelcopy.NodePlan("lab-1", ROOT, [], 1, 2 << 30), reserve_bytes=1 << 30)  # fits: no error


def test_streams_balance_bytes() -> None:
    entries = [Entry(f"f{i}", "f", size) for i, size in enumerate([100, 90, 60, 40, 10, 5])]
    groups = modelcopy.streams(entries, 3)
    assert sorted(sum(e.size for e in g) for g in groups) == [100, 100, 105]
    assert sorted(e.path for g in groups for e in g) == sorted(e.path for e in entries)
    assert len(modelcopy.streams(entries[:1], 4)) == 1


def test_hf_blob_verification_by_name_and_sha256sum_output() -> None:
    data = b"weights"
    digest = hashlib.sha256(data).hexdigest()
    entries = [Entry(f"blobs/{digest}", "f", 7), Entry("blobs/0123456789abcdef0123456789abcdef01234567", "f", 3),
               Entry("refs/main", "f", 40), Entry("snapshots/r/x", "l", 10, "../../blobs/x")]
    assert modelcopy.hash_checks(entries, "sha256_blobs") == [f"blobs/{digest}"]
    assert modelcopy.hash_checks(entries, "sha256_all") == [
        f"blobs/{digest}", "blobs/0123456789abcdef0123456789abcdef01234567", "refs/main"]
    expected = {f"blobs/{digest}": digest}
    assert modelcopy.hash_mismatches(expected, f"{digest}  blobs/{digest}\n") == []
    assert modelcopy.hash_mismatches(expected, f"{'0' * 64}  blobs/{digest}\n") == [f"blobs/{digest}"]
    assert modelcopy.hash_mismatches(expected, "") == [f"blobs/{digest}"], "a file sha256sum did not hash is wrong"


def test_rsync_stats_bytes() -> None:
    stats = ("Number of files: 3\nTotal file size: 2,535,878 bytes\nTotal bytes sent: 2,537,120\n"
             "Total bytes received: 81\n")  # rsync 3.2.7 --stats
    assert modelcopy.sent_bytes(stats) == 2_537_120


# --- image layers ----------------------------------------------------------------------------------------------
DIFFS = ["sha256:" + c * 64 for c in "abcd"]


def test_chain_ids_and_the_layers_a_node_holds() -> None:
    chains = layerdelta.chain_ids(DIFFS)
    assert chains[0] == DIFFS[0]
    assert chains[1] == "sha256:" + hashlib.sha256(f"{DIFFS[0]} {DIFFS[1]}".encode()).hexdigest()
    assert layerdelta.layers_to_skip(DIFFS, [DIFFS[:2], [DIFFS[0], DIFFS[2]]]) == chains[:2]
    assert layerdelta.layers_to_skip(DIFFS, [[DIFFS[1]]]) == [], "the same diff on another base is another layer"


def save_stream(layers: list[tuple[str, dict, bytes]]) -> bytes:
    """A legacy `docker save` stream: <v1id>/{VERSION,json,layer.tar} per layer, then manifest.json."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for v1, meta, data in layers:
            for name, body in (("VERSION", b"1.0"), ("json", json.dumps(meta).encode()), ("layer.tar", data)):
                info = tarfile.TarInfo(f"{v1}/{name}")
                info.size = len(body)
                tar.addfile(info, io.BytesIO(body))
        info = tarfile.TarInfo("manifest.json")
        info.size = 2
        tar.addfile(info, io.BytesIO(b"[]"))
    return buf.getvalue()


def test_filtered_save_stream_leaves_out_only_the_held_layers() -> None:
    chains = layerdelta.chain_ids(DIFFS[:3])
    metas, v1s, parent = [], [], ""
    for chain in chains:  # as Docker's save names the layers (image/v1.CreateID)
        meta = {"container_config": {"Cmd": ["/bin/sh", "-c", "a && b <x>"]}, "created": "1970-01-01T00:00:00Z"}
        v1 = layerdelta.v1_id(meta, chain, f"sha256:{parent}" if parent else "")
        metas.append({"id": v1, **({"parent": parent} if parent else {}), **meta, "os": "linux"})
        v1s.append(v1)
        parent = v1
    stream = save_stream([(v1, m, bytes([i]) * 1000) for i, (v1, m) in enumerate(zip(v1s, metas, strict=True))])
    out = io.BytesIO()
    left_out, left_bytes = layerdelta.filter_stream(io.BytesIO(stream), out, DIFFS[:3], set(chains[:2]))
    assert (left_out, left_bytes) == (2, 2000)
    names = tarfile.open(fileobj=io.BytesIO(out.getvalue())).getnames()
    assert f"{v1s[2]}/layer.tar" in names and f"{v1s[0]}/layer.tar" not in names and f"{v1s[1]}/json" in names
    assert "manifest.json" in names
    assert tarfile.open(fileobj=io.BytesIO(out.getvalue())).extractfile(f"{v1s[2]}/layer.tar").read() == b"\x02" * 1000


def test_a_layer_whose_v1_id_is_not_reproduced_is_sent() -> None:
    meta = {"id": "f" * 64, "created": "1970-01-01T00:00:00Z"}
    stream = save_stream([("f" * 64, meta, b"x" * 10)])
    out = io.BytesIO()
    assert layerdelta.filter_stream(io.BytesIO(stream), out, DIFFS[:1], {DIFFS[0]}) == (0, 0)
    assert "f" * 64 + "/layer.tar" in tarfile.open(fileobj=io.BytesIO(out.getvalue())).getnames()


def test_02_warns_of_a_model_another_node_holds_and_blocks_one_no_node_holds() -> None:
    from sparkbook.core.values.fanout import Outcome
    from sparkbook.stages.diagnose.checks import ModelFiles, model_findings

    held = ModelFiles("h", "/m", {"architectures": ["X"]}, None, [10])
    missing = ModelFiles("w", "", None, None, [], "org/m is not in /cache")
    (finding,) = model_findings({"h": Outcome("h", held), "w": Outcome("w", missing)})
    assert (finding.severity, finding.text) == ("warning", "w: org/m is not in /cache; 03 copies it from h")
    (alone,) = model_findings({"w": Outcome("w", missing)})
    assert alone.severity == "blocker"


def test_the_save_command_filters_only_where_the_node_holds_layers() -> None:
    from sparkbook.stages.images import distribute

    assert distribute.save_argv("img:1", None) == ["docker", "save", "img:1"]
    assert distribute.save_argv("img:1", (DIFFS, [])) == ["docker", "save", "img:1"]
    argv = distribute.save_argv("img:1", (DIFFS, DIFFS[:1]))
    assert argv[:4] == ["bash", "--norc", "--noprofile", "-c"]
    assert argv[4].startswith("set -o pipefail; docker save img:1 | python3 -c ")
    assert argv[4].endswith(f"{','.join(DIFFS)} {DIFFS[0]}")
