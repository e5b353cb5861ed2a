"""Put the model on every node (part of 03, after the image): pushed node to node over the fabric, resumable.

    listing(node, model, root=None) -> Listing      what a node holds: HF cache (refs/main, snapshot, blobs) or a dir
    wanted(listing) -> dict[path, Entry]            what a complete copy consists of (from the source's listing)
    plan(listings, head) -> ModelCopyPlan           the source node and, per node, the entries it lacks or holds wrong
    streams(entries, n) -> list[list[Entry]]        the files split into n streams of about equal bytes
    copy_model(ctx) -> ModelCopy                    plan; each lacking node: disk check, rsync streams, verify, rename

A node lacking the model gets it from a node that has it (the head first): rsync runs ON the source and pushes
to the target's fabric IP, into a staging dir beside the model (`.<name>.sparkbook-incoming`), with --partial and
--size-only, so a killed run resumes without re-sending finished files. The staged files are verified (sizes; the
sha256 where an HF blob's name is its sha256, or every file with model.transfer.verify: sha256_all) and only then
moved where vLLM loads them: blobs and files first, snapshot symlinks next, refs/main last.
"""
from __future__ import annotations

import posixpath
import re
import shlex
import threading
import time
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Literal

from ...core.cluster.context import Context
from ...core.cluster.nodes import Node, shell
from ...core.cluster.nodestate import ensure
from ...core.cluster.progress import Progress
from ...core.values.errors import SparkbookError
from ...core.values.params import ModelSpec, NodeSpec, Params
from ...core.values.stagelist import IMAGES

INCOMING = ".sparkbook-incoming"
LIST_TIMEOUT_S = 60
POLL_S = 2.0
SHA256 = re.compile(r"^[0-9a-f]{64}$")

LISTING = r"""
root={root}; stage={stage}
d="$root"; while [ ! -d "$d" ]; do d=$(dirname "$d"); done
echo ==free==; df -B1 --output=avail "$d" | tail -1
echo ==root==; [ -d "$root" ] && echo yes
echo ==ref==; cat "$root/refs/main" 2>/dev/null; echo
echo ==files==; [ -d "$root" ] && (cd "$root" && find . \( -type f -o -type l \) -printf '%y\t%s\t%P\t%l\n')
echo ==staged==; [ -d "$stage" ] && (cd "$stage" && find . \( -type f -o -type l \) -printf '%y\t%s\t%P\t%l\n')
echo ==end==
"""
HASHES = 'cd {dir} && sha256sum -- "$@"'
# moved into place: regular files first, then symlinks, refs/ last; a missing model dir is renamed whole
FINALIZE = r"""
root={root}; stage={stage}
if [ ! -d "$root" ]; then mv "$stage" "$root" && exit 0; fi
cd "$stage" || exit 3
for kind in f l; do
  find . -path ./refs -prune -o -type $kind -printf '%P\n' | while IFS= read -r p; do
    mkdir -p "$root/$(dirname "$p")" && mv -f "$p" "$root/$p" || exit 4
  done || exit 4
done
if [ -d refs ]; then
  find refs -type f | while IFS= read -r p; do mkdir -p "$root/$(dirname "$p")" && mv -f "$p" "$root/$p"; done
fi
cd / && rm -rf "$stage"
"""
# the stream's PID in the source's state dir (the runbook's own), written afresh: a link there is not followed
RSYNC = 'rm -f {pidfile}; ( set -C; echo $$ >{pidfile} ) && exec rsync "$@"'


@dataclass(frozen=True)
class Entry:
    """One file or symlink of the model, by its path relative to the model's root."""

    path: str
    kind: Literal["f", "l"]  # find's type: a regular file | a symlink
    size: int
    target: str = ""  # a symlink's target

    @property
    def is_link(self) -> bool:
        match self.kind:
            case "l":
                return True
            case "f":
                return False

    @property
    def is_file(self) -> bool:
        return not self.is_link


@dataclass(frozen=True)
class Listing:
    """What one node holds at the model's root (and in its staging dir), and its disk's free space there."""

    node: str
    root: str
    layout: str  # "hf" | "dir"
    exists: bool
    entries: dict[str, Entry]
    staged: dict[str, Entry]
    free_bytes: int
    ref: str = ""  # hf: what refs/main names

    @property
    def stage(self) -> str:
        return staging_dir(self.root)


@dataclass(frozen=True)
class NodePlan:
    """One target node's part of the copy: the entries it lacks or holds with another size or target."""

    node: str
    root: str
    entries: list[Entry]
    bytes_to_send: int  # files not already complete in its staging dir
    free_bytes: int


@dataclass(frozen=True)
class ModelCopyPlan:
    """The source (a node with a complete copy) and what each other node needs from it."""

    source: str
    root: str
    layout: str
    wanted: dict[str, Entry]
    nodes: list[NodePlan]
    complete: list[str]  # nodes whose copy already matches

    @property
    def total_bytes(self) -> int:
        return sum(e.size for e in self.wanted.values() if e.is_file)


@dataclass(frozen=True)
class NodeCopy:
    """One node's copy: bytes rsync sent, time, and what the verification found."""

    node: str
    files: int
    bytes_sent: int
    seconds: float
    verified: list[str]  # "sizes", "sha256 of N blobs" ...
    error: str = ""

    @property
    def mb_s(self) -> float:
        return round(self.bytes_sent / 1e6 / self.seconds, 1) if self.seconds else 0.0


@dataclass(frozen=True)
class ModelCopy:
    """The outcome: what was copied where, and whether every node now holds the same files."""

    source: str
    root: str
    copies: list[NodeCopy]
    skipped: list[str]
    matches: dict[str, bool] = field(default_factory=dict)

    @property
    def verified(self) -> bool:
        return all(self.matches.values()) and not any(c.error for c in self.copies)

    @property
    def message(self) -> str:
        if not self.copies:
            return f"every node already holds the model at {self.root}: nothing copied"
        done = ", ".join(f"{c.node} ({c.files} files, {c.bytes_sent / 1e9:.2f} GB sent at {c.mb_s} MB/s)"
                         for c in self.copies)
        state = "every node's copy verified" if self.verified else "COPIES DIFFER OR FAILED"
        return f"copied the model from {self.source} to {done}; {state}"

    def rows(self) -> list[dict[str, object]]:
        done = {c.node: c for c in self.copies}
        return [{"node": node, "matches source": ok,
                 "action": (f"copied {done[node].files} files, {done[node].bytes_sent / 1e9:.3f} GB in "
                            f"{done[node].seconds:.1f} s ({done[node].mb_s} MB/s); verified "
                            f"{', '.join(done[node].verified) or 'nothing'}"
                            + (f": {done[node].error}" if done[node].error else "")) if node in done else
                           ("the source" if node == self.source else "already complete: skipped")}
                for node, ok in self.matches.items()]


class ModelCopyError(SparkbookError):
    """The model could not be put on a node; the message names the node, the path and why."""

    stage = IMAGES.name


class DiskTooSmall(ModelCopyError):
    """A node's disk cannot take the model (checked before anything is sent)."""


def size_bytes(size: str) -> int:
    """A params size ("512M", "1G", "100") in bytes."""
    return int(size.rstrip("KMGkmg")) * {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(size[-1].upper(), 1)


def staging_dir(root: str) -> str:
    path = PurePosixPath(root)
    return str(path.parent / f".{path.name}{INCOMING}")


def repo_dir(model: ModelSpec) -> str:
    """hf_id's directory name in the hub cache."""
    return "models--" + (model.hf_id or "").replace("/", "--")


def roots(model: ModelSpec) -> list[str]:
    """Where the model may live on a node: model.path, or the repo in cache_dir/hub then in cache_dir."""
    if model.path:
        return [model.path]
    return [f"{model.cache_dir}/hub/{repo_dir(model)}", f"{model.cache_dir}/{repo_dir(model)}"]


def parse_listing(node: str, root: str, layout: str, text: str) -> Listing:
    """The LISTING script's output -> Listing."""
    pieces = re.split(r"^==(\w+)==$", text, flags=re.M)
    parts = dict(zip(pieces[1::2], pieces[2::2], strict=False))
    if not parts.get("free", "").split():
        raise ModelCopyError(f"{node}: cannot list {root}: {text.strip()[-300:]}", node=node)
    entries = _entries(parts.get("files", ""))
    ref = parts.get("ref", "").strip() if layout == "hf" and "refs/main" in entries else ""
    return Listing(node, root, layout, parts.get("root", "").strip() == "yes", entries,
                   _entries(parts.get("staged", "")), int(parts["free"].split()[-1]), ref)


def _entries(text: str) -> dict[str, Entry]:
    out = {}
    for line in filter(None, text.splitlines()):
        kind, size, path, target = (line.split("\t") + ["", "", ""])[:4]
        match kind:
            case "f" | "l":
                out[path] = Entry(path, kind, int(size), target)
    return out


def listing(node: Node, model: ModelSpec, root: str | None = None) -> Listing:
    """What `node` holds of the model; at `root` where given (a target follows the source's location), else at
    the first of `roots` that exists (the last one when none does)."""
    layout = "dir" if model.path else "hf"
    candidates = [root] if root else roots(model)
    for where in candidates:
        r = node.run(shell(LISTING, root=where, stage=staging_dir(where)), timeout=LIST_TIMEOUT_S)
        found = parse_listing(node.name, where, layout, r.stdout)
        if found.exists:
            break
    return found


def wanted(src: Listing) -> dict[str, Entry]:
    """A complete copy: for an HF cache refs/main, its snapshot's symlinks and the blobs they name; for a
    plain dir every file and symlink. Empty where the source's copy is itself incomplete."""
    if src.layout == "dir":
        return dict(src.entries)
    if not src.ref:
        return {}
    prefix = f"snapshots/{src.ref}/"
    out = {"refs/main": src.entries["refs/main"]}
    for path, e in src.entries.items():
        if not path.startswith(prefix):
            continue
        out[path] = e
        if e.is_link:
            blob = posixpath.normpath(posixpath.join(posixpath.dirname(path), e.target))
            if blob not in src.entries:
                return {}  # a snapshot link to a missing blob: not a complete copy
            out[blob] = src.entries[blob]
    return out if len(out) > 1 else {}  # refs/main naming an empty or missing snapshot: not a copy


def lacking(want: dict[str, Entry], have: dict[str, Entry]) -> list[Entry]:
    """The wanted entries a node lacks or holds with another size (file) or target (symlink)."""
    return [e for path, e in sorted(want.items())
            if path not in have or have[path].kind != e.kind
            or (e.size != have[path].size if e.is_file else e.target != have[path].target)]


def plan(listings: dict[str, Listing], head: str) -> ModelCopyPlan:
    """The source (the head where its copy is complete, else the first node whose is) and each other node's needs."""
    complete = [n for n in [head, *listings] if wanted(listings[n])]
    if not complete:
        raise ModelCopyError("no node holds a complete copy of the model: "
                             + "; ".join(f"{n}: {_describe(lst)}" for n, lst in listings.items()),
                             remediation="put the model on one node (the head), then run 03 again")
    src = listings[complete[0]]
    want = wanted(src)
    nodes, done = [], []
    for name, lst in listings.items():
        if name == src.node:
            continue
        need = lacking(want, lst.entries)
        if not need:
            done.append(name)
            continue
        staged_ok = {p for p, e in lst.staged.items() if p in want and not lacking({p: want[p]}, {p: e})}
        left = sum(e.size for e in need if e.is_file and e.path not in staged_ok)
        nodes.append(NodePlan(name, lst.root, need, left, lst.free_bytes))
    return ModelCopyPlan(src.node, src.root, src.layout, want, nodes, done)


def _describe(lst: Listing) -> str:
    if not lst.exists:
        return f"{lst.root} does not exist"
    return f"{lst.root} holds {len(lst.entries)} files" + ("" if lst.layout == "dir" else ", no refs/main snapshot")


def check_disk(p: NodePlan, reserve_bytes: int) -> None:
    """Refuse before copying when the node's disk cannot take what is left to send plus the reserve."""
    if p.bytes_to_send + reserve_bytes > p.free_bytes:
        raise DiskTooSmall(
            f"{p.node}: {p.root}: the disk has {p.free_bytes / 1e9:.2f} GB free; the model needs "
            f"{p.bytes_to_send / 1e9:.2f} GB more plus model.transfer.reserve {reserve_bytes / 1e9:.2f} GB "
            f"(short by {(p.bytes_to_send + reserve_bytes - p.free_bytes) / 1e9:.2f} GB)", node=p.node,
            stage=IMAGES.name,
            remediation="free space on that disk, or put the model cache on a larger one (model.cache_dir)")


def streams(entries: list[Entry], n: int) -> list[list[Entry]]:
    """Split entries into at most n groups of about equal bytes (largest first onto the lightest group)."""
    groups: list[tuple[int, list[Entry]]] = [(0, []) for _ in range(max(1, min(n, len(entries))))]
    for e in sorted(entries, key=lambda e: (-e.size, e.path)):
        i = min(range(len(groups)), key=lambda k: groups[k][0])
        groups[i] = (groups[i][0] + e.size, [*groups[i][1], e])
    return [g for _, g in groups if g]


def hash_checks(want: list[Entry], verify: str) -> list[str]:
    """The staged files whose sha256 is checked: HF blobs named by their sha256, or every file (sha256_all)."""
    return [e.path for e in want if e.is_file
            and (verify == "sha256_all" or (e.path.startswith("blobs/") and SHA256.match(PurePosixPath(e.path).name)))]


def hash_mismatches(expected: dict[str, str], sha256sum_output: str) -> list[str]:
    """Paths whose sha256 (from `sha256sum` output) differs from the expected one (or is missing)."""
    got = {}
    for line in sha256sum_output.splitlines():
        digest, _, path = line.partition("  ")
        got[path.lstrip("*")] = digest
    return sorted(p for p, want in expected.items() if got.get(p) != want)


def pid_file(state_dir: str, target: str, i: int) -> str:
    """Where the source node writes the PID of the rsync stream `i` towards `target` (to stop one by PID): its
    state dir (core.cluster.nodestate)."""
    return f"{state_dir}/modelcopy-{target}-{i}.pid"


def rsync_argv(spec: NodeSpec, params: Params, src_root: str, stage: str, stream: int, state_dir: str) -> list[str]:
    """rsync on the source pushing a --files-from list (stdin) to the target's fabric IP, resumably."""
    t = params.model.transfer
    ssh = shlex.join(["ssh", "-p", str(spec.ssh_port or params.ssh.port), "-o", "BatchMode=yes",
                      "-o", f"ConnectTimeout={params.ssh.connect_timeout_s:g}"])
    user = spec.ssh_user or params.ssh.user
    argv = ["-a", "--partial", "--size-only", "--stats", "--files-from=-", "-e", ssh,
            *([f"--bwlimit={int(t.bwlimit_mbs * 1000)}"] if t.bwlimit_mbs else []),
            f"{src_root}/", f"{user}@{spec.fabric_ip}:{stage}/"]
    return ["sh", "-c", RSYNC.format(pidfile=shlex.quote(pid_file(state_dir, spec.name, stream))),
            "rsync", *argv]


def sent_bytes(stats: str) -> int:
    """`Total bytes sent: 1,234` from rsync --stats."""
    m = re.search(r"Total bytes sent: ([\d,.]+)", stats)
    return int(re.sub(r"[,.]", "", m.group(1))) if m else 0


def copy_node(ctx: Context, cp: ModelCopyPlan, p: NodePlan) -> NodeCopy:
    """One target: its streams in parallel (the source pushes over the fabric), then verify, then rename."""
    params, t = ctx.params, ctx.params.model.transfer
    source, target = ctx.cluster.nodes[cp.source], ctx.cluster.nodes[p.node]
    stage = staging_dir(p.root)
    ensure(source)  # its state dir (the streams' PID files) refused here, before anything is sent, if not our own
    target.run(["mkdir", "-p", stage], timeout=LIST_TIMEOUT_S, check=True)
    files = list(p.entries)
    results: list[tuple[int, str]] = []
    t0 = time.monotonic()
    stop = threading.Event()
    watcher = threading.Thread(target=_watch, args=(target, stage, p, stop), daemon=True)
    watcher.start()
    try:
        workers = [threading.Thread(target=_stream, args=(source, params, p, cp.root, stage, i, group, t.timeout_s,
                                                          results), daemon=True)
                   for i, group in enumerate(streams(files, t.streams))]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    finally:
        stop.set()
        watcher.join(timeout=10)
    seconds = time.monotonic() - t0
    sent = sum(b for b, _ in results)
    errors = [e for _, e in results if e]
    if errors:
        return NodeCopy(p.node, len(files), sent, seconds, [], "; ".join(errors))
    verified, problem = verify(ctx, cp, p, stage)
    if problem:
        return NodeCopy(p.node, len(files), sent, seconds, verified, problem)
    r = target.run(shell(FINALIZE, root=p.root, stage=stage), timeout=LIST_TIMEOUT_S)
    error = "" if r.ok else f"{p.node}: moving {stage} into {p.root} failed: {r.stderr.strip()[-300:]}"
    return NodeCopy(p.node, len(files), sent, seconds, verified, error)


def _stream(source: Node, params: Params, p: NodePlan, src_root: str, stage: str, i: int, group: list[Entry],
            timeout: float, results: list[tuple[int, str]]) -> None:
    spec = params.node(p.node)
    listing_bytes = "".join(f"{e.path}\n" for e in group).encode()
    try:
        r = source.run(rsync_argv(spec, params, src_root, stage, i, ensure(source)), timeout=timeout,
                       stdin=listing_bytes)
    except Exception as exc:  # the stream's failure is reported with its node, not raised from a thread
        results.append((0, f"{source.name} -> {p.node}: stream {i} failed: {exc}"))
        return
    error = "" if r.ok else (f"{source.name} -> {p.node} ({spec.fabric_ip}): rsync stream {i} "
                             f"{'timed out' if r.timed_out else f'exited {r.exit_code}'}: {r.stderr.strip()[-300:]}")
    results.append((sent_bytes(r.stdout), error))


def _watch(target: Node, stage: str, p: NodePlan, stop: threading.Event) -> None:
    """Progress per node: the bytes in its staging dir, every POLL_S."""
    total = sum(e.size for e in p.entries if e.is_file)
    with Progress(f"model to {p.node}", total=total / 1e6, unit=" MB") as bar:
        while not stop.wait(POLL_S):
            r = target.run(["du", "-sb", stage], timeout=30)
            if r.ok and r.stdout.split():
                bar.update(int(r.stdout.split()[0]) / 1e6)


def verify(ctx: Context, cp: ModelCopyPlan, p: NodePlan, stage: str) -> tuple[list[str], str]:
    """The staged copy against the source: sizes (and symlink targets) of every entry, then the sha256s. A file
    whose hash is wrong is removed, so the next run sends it again. Returns (what was verified, problem)."""
    target = ctx.cluster.nodes[p.node]
    staged = listing(target, ctx.params.model, p.root).staged
    bad = lacking({e.path: e for e in p.entries}, staged)
    if bad:
        return [], (f"{p.node}: after the copy {stage} lacks or holds with another size: "
                    + ", ".join(e.path for e in bad[:5]))
    checked = hash_checks(p.entries, ctx.params.model.transfer.verify)
    if not checked:
        return ["sizes"], ""
    expected = {path: PurePosixPath(path).name for path in checked if SHA256.match(PurePosixPath(path).name)}
    if ctx.params.model.transfer.verify == "sha256_all":
        expected = _sha256(ctx.cluster.nodes[cp.source], cp.root, checked)
    got = target.run(["sh", "-c", HASHES.format(dir=shlex.quote(stage)), "sha256", *checked],
                     timeout=ctx.params.model.transfer.timeout_s)
    wrong = hash_mismatches(expected, got.stdout)
    if wrong:
        target.run(["rm", "-f", *(f"{stage}/{w}" for w in wrong)], timeout=LIST_TIMEOUT_S)
        return ["sizes"], f"{p.node}: sha256 mismatch in {stage} (removed, sent again next run): {', '.join(wrong[:5])}"
    return ["sizes", f"sha256 of {len(expected)} files"], ""


def _sha256(node: Node, root: str, paths: list[str]) -> dict[str, str]:
    r = node.run(["sh", "-c", HASHES.format(dir=shlex.quote(root)), "sha256", *paths], timeout=7200, check=True)
    return {path: digest for digest, _, path in (line.partition("  ") for line in r.stdout.splitlines())}


def listings(ctx: Context) -> dict[str, Listing]:
    """Every node's listing; nodes follow the head's location of the model where they lack it."""
    model = ctx.params.model
    outcomes = ctx.cluster.fan_out(lambda n: listing(n, model), timeout=LIST_TIMEOUT_S * 3)
    found = {name: o.ok_value for name, o in outcomes.items() if o.ok}
    if len(found) < len(outcomes):
        raise ModelCopyError(outcomes.errors())
    located = next((lst.root for lst in found.values() if lst.exists and wanted(lst)), None)
    if located:  # a node without the model gets it where the source keeps it (cache_dir/hub or cache_dir)
        found = {n: lst if lst.root == located else listing(ctx.cluster.nodes[n], model, located)
                 for n, lst in found.items()}
    return found


def copy_model(ctx: Context) -> ModelCopy:
    """Plan, refuse when a disk is too small (before sending anything), copy each lacking node, verify all."""
    cp = plan(listings(ctx), ctx.head.name)
    reserve = size_bytes(ctx.params.model.transfer.reserve)
    for p in cp.nodes:
        check_disk(p, reserve)
    outcomes = ctx.cluster.fan_out(lambda n: copy_node(ctx, cp, next(p for p in cp.nodes if p.node == n.name)),
                                   [ctx.cluster.nodes[p.node] for p in cp.nodes],
                                   timeout=ctx.params.model.transfer.timeout_s + 600, label="model copies")
    copies = [o.ok_value if o.ok else NodeCopy(name, 0, 0, o.duration_s, [], str(o.error))
              for name, o in outcomes.items()]
    after = listings(ctx)
    matches = {n: not lacking(cp.wanted, lst.entries) for n, lst in after.items()}
    return ModelCopy(cp.source, cp.root, copies, cp.complete, matches)
