"""The script every ``torchrun`` rank runs for ``tests/test_mesh2d.py``: quantized weights on 2-D meshes.

    python -m torch.distributed.run --nproc-per-node N tests/mesh2d_worker.py COMMAND DIR

Sources, saved at 4 ranks on a ``(dp=2, tp=2)`` mesh, each torchao case as DTensors with the
placements torchtitan's FSDP2 x TP gives its weights (checked against a real model here):

- ``colwise``: ``(_StridedShard(0, sf=2), Shard(0))`` (``ColwiseParallel``, then ``fully_shard``);
- ``rowwise``: ``(Shard(0), Shard(1))`` (``RowwiseParallel``, then ``fully_shard``);
- ``hsdp``: ``(Replicate(), Shard(0))`` (replicate x shard);

each rank's local tensor quantized from its own block of the high-precision tensor (a sharded
quantize), so a ``rowwise`` int8/float8 weight has one scale per row *half*.

Targets, loaded with ``QuantizedLoadPlanner``, at: the same mesh and layout (same type: every
inner buffer bit-identical to the source's; plain: the source's values); 1-D FSDP over 4
(``Shard(0)``); 1-D TP over 2 (``Shard(0)`` and ``Shard(1)``); another 2-D shape, ``(1, 4)`` with
``(Shard(0), Shard(1))``; one process (whole tensors). A same-type target each of whose scale
blocks lies inside one source block (per-row targets: any; block-scaled and optimizer state: covering
what one of the source's did) gets the source's bits (raw);
any other gets ``from_hp`` of the checkpoint's values (dequantize, then quantize like the target):
both are asserted bit-exact (docs/api.md, *When a target gets the source's bits*). Plain targets equal the
library's ``dequantize()`` of the source blocks.

``replicas`` (4 ranks): HSDP replicas that diverged are named, key and rank, by
``QuantizedSavePlanner(check_replicas=True)`` before anything is written.

Commands: ``save`` (4 ranks; also checks that a real ``parallelize_module`` + ``fully_shard`` model
gets these placements), ``replicas`` (4), ``load-same`` / ``load-fsdp`` / ``load-other`` (4),
``load-tp`` (2), ``load-single`` (1). A real model trained at FSDP2 x TP, checkpointed and resumed:
``mesh2d_training_worker.py``.

Where CUDA has a device per rank, the ranks run nccl with their tensors on their GPU (the
multi-GPU suite); gloo on CPU otherwise. Expectations are computed on CPU either way.
"""

from __future__ import annotations

import json
import os
import sys
import warnings

warnings.filterwarnings("ignore")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import Replicate, Shard  # noqa: E402
from torch.distributed.tensor.placement_types import _StridedShard  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import qdcp  # noqa: E402
from dist_helpers import dtensor_from_local, init_torchrun_mesh  # noqa: E402
from qdcp import QuantizedLoadPlanner, QuantizedSavePlanner, to_device  # noqa: E402
from quantized_cases import CASE_BY_NAME, components_diff  # noqa: E402
from worker_results import RANK, WORLD, check, qdcp_error_in, run, short  # noqa: E402

SHAPE = (128, 128)
NAMES = ("int8_row", "float8_row", "mx_fp8", "nvfp4", "optim8bit_signed", "optim4bit", "optimfp8")
LAYOUTS = {"colwise": (_StridedShard(0, split_factor=2), Shard(0)), "rowwise": (Shard(0), Shard(1)),
           "hsdp": (Replicate(), Shard(0))}
FLAT = {"optim8bit_signed": 256, "optim4bit": 128, "optimfp8": 256}  # torchao optimizer state: flat blocks
PER_ROW = ("int8_row", "float8_row")  # one scale per row of the (local) tensor
COL_BLOCK = {"mx_fp8": 32, "nvfp4": 16}  # scales per block of columns
Block = tuple[int, int, int, int]  # row offset, column offset, rows, columns
CUDA = torch.cuda.is_available() and torch.cuda.device_count() >= WORLD
DEVICE = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if CUDA else torch.device("cpu")


def hp(name: str) -> torch.Tensor:
    return CASE_BY_NAME[name].hp(7, SHAPE)


def block_of(mesh, placements, shape=SHAPE) -> Block:
    """This rank's block of a ``shape`` DTensor with ``placements`` on ``mesh``."""
    probe = dtensor_from_local(torch.empty(0), mesh, placements, shape, torch.float32)
    c = probe.__create_chunk_list__()[0]
    return (c.offsets[0], c.offsets[1], c.sizes[0], c.sizes[1])


def cut(t: torch.Tensor, b: Block) -> torch.Tensor:
    return t[b[0]:b[0] + b[2], b[1]:b[1] + b[3]].contiguous()


def source_blocks(root: str) -> dict[str, list[Block]]:
    with open(os.path.join(root, "blocks.json")) as f:
        return {k: [tuple(b) for b in v] for k, v in json.load(f).items()}


def values(name: str, blocks: list[Block]) -> torch.Tensor:
    """What the checkpoint's entry stands for: each source block's dequantized local, in place."""
    case, full = CASE_BY_NAME[name], hp(name)
    out = torch.empty(SHAPE, dtype=case.dtype)
    for b in blocks:
        out[b[0]:b[0] + b[2], b[1]:b[1] + b[3]] = case.dequantize(case.from_hp(cut(full, b)))
    return out


def raw_fits(name: str, target: Block, sources: list[Block]) -> bool:
    """Whether a same-type target block can take the source's bits: each of its scale blocks (a
    row of it; a row's group of columns; a pair of whole rows of flat optimizer state) lies inside
    one source block, and covers the elements one of the source's scale blocks did."""
    def inside(r0, c0, rows, cols, ok=lambda s: True):
        return any(s[0] <= r0 and r0 + rows <= s[0] + s[2] and s[1] <= c0 and c0 + cols <= s[1] + s[3] and ok(s)
                   for s in sources)
    rows = range(target[0], target[0] + target[2])
    if name in PER_ROW:  # docs/api.md: a target row inside a source row block takes its codes and scale
        return all(inside(r, target[1], 1, target[3]) for r in rows)
    if name in COL_BLOCK:
        k = COL_BLOCK[name]
        return all(inside(r, c, 1, k, lambda s, c=c: (c - s[1]) % k == 0)
                   for r in rows for c in range(target[1], target[1] + target[3], k))
    rb, cb = flat_block(name, target)  # the target's blocks: of its own elements (torchao's state is per shard)
    return all(inside(r, c, rb, cb, lambda s, r=r, c=c: flat_block(name, s) == (rb, cb)
                      and (r - s[0]) % rb == 0 and (c - s[1]) % cb == 0)
               for r in range(target[0], target[0] + target[2], rb)
               for c in range(target[1], target[1] + target[3], cb))


def flat_block(name: str, b: Block) -> tuple[int, int]:
    """The rows x columns of the logical tensor that one block of a shard's optimizer state covers:
    its ``FLAT[name]`` consecutive elements of the shard (``b``)."""
    g = FLAT[name]
    return (1, g) if b[3] % g == 0 else (g // b[3], b[3])


def expected_local(name: str, target: Block, sources: list[Block]) -> torch.Tensor:
    """The same-type target's local tensor the load must give: the source's bits, or the
    checkpoint's values quantized like the target."""
    case = CASE_BY_NAME[name]
    if raw_fits(name, target, sources) and name in PER_ROW:
        return source_rows(name, target, sources)
    if raw_fits(name, target, sources):
        return case.from_hp(cut(hp(name), target))
    return case.from_hp(cut(values(name, sources), target))


def source_rows(name: str, target: Block, sources: list[Block]) -> torch.Tensor:
    """A per-row target each of whose rows lies inside a source block: its rows cut by torchao from
    the source blocks holding them (their codes, each row's scale), stacked."""
    case, pieces = CASE_BY_NAME[name], []
    for s in sorted(set(sources)):  # HSDP's replicas: one of each block
        lo, hi = max(s[0], target[0]), min(s[0] + s[2], target[0] + target[2])
        if lo < hi and s[1] <= target[1] and target[1] + target[3] <= s[1] + s[3]:
            q = case.from_hp(cut(hp(name), s))
            pieces.append((lo, q[lo - s[0]:hi - s[0], target[1] - s[1]:target[1] - s[1] + target[3]]))
    pieces = [p for _, p in sorted(pieces, key=lambda x: x[0])]
    names, attrs = pieces[0].__tensor_flatten__()
    inner = {n: torch.cat([getattr(p, n) for p in pieces]) for n in names}
    shape = torch.Size((target[2], target[3]))
    return type(pieces[0]).__tensor_unflatten__(inner, attrs, shape, torch.empty(shape, device="meta").stride())


# ----------------------------------------------------------------------------- save

def mesh2d(shape=(2, 2)):
    return init_device_mesh(DEVICE.type, shape, mesh_dim_names=("dp", "tp"))


def mesh1d():
    return init_device_mesh(DEVICE.type, (WORLD,))


def real_placements(mesh) -> dict[str, tuple]:
    """The placements torchtitan's recipe gives real weights: TP (``parallelize_module``) then
    FSDP2 (``fully_shard``) over ``dp``; and HSDP (``fully_shard`` on the 2-D mesh)."""
    import torch.nn as nn
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    tp_fsdp = nn.Sequential(nn.Linear(SHAPE[1], SHAPE[0], bias=False), nn.ReLU(),
                            nn.Linear(SHAPE[0], SHAPE[1], bias=False))
    tp_fsdp.to(DEVICE)
    parallelize_module(tp_fsdp, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(tp_fsdp, mesh=mesh["dp"])
    hsdp = fully_shard(nn.Linear(SHAPE[1], SHAPE[0], bias=False, device=DEVICE), mesh=mesh)
    return {"colwise": tp_fsdp[0].weight.placements, "rowwise": tp_fsdp[2].weight.placements,
            "hsdp": hsdp.weight.placements}


def save(root: str, mesh) -> None:
    mesh = mesh2d()
    real = real_placements(mesh)
    check("save", real == {k: tuple(v) for k, v in LAYOUTS.items()}, f"torch gives real weights {real}")
    state, blocks = {}, {}
    for name in NAMES:
        case = CASE_BY_NAME[name]
        for layout, placements in LAYOUTS.items():
            b = block_of(mesh, placements)
            t = dtensor_from_local(case.from_hp(cut(hp(name), b).to(DEVICE)), mesh, placements, SHAPE, case.dtype)
            state[f"{name}.{layout}"] = t
            gathered: list = [None] * WORLD
            dist.all_gather_object(gathered, b)
            blocks[f"{name}.{layout}"] = gathered
    dcp.save(state, checkpoint_id=os.path.join(root, "main"), planner=QuantizedSavePlanner(check_replicas=True))
    check_written_once(root, blocks)
    check_column_cut_state(root, mesh)
    _save_refused(root, mesh)
    if RANK == 0:
        with open(os.path.join(root, "blocks.json"), "w") as f:
            json.dump(blocks, f)
    dist.barrier()


def check_column_cut_state(root: str, mesh) -> None:
    """Optimizer state of a column-cut weight is stored as the grid its per-shard blocks form: a
    scale per (rows, columns) block of the logical tensor."""
    specs = qdcp.spec.read_specs(dcp.FileSystemReader(os.path.join(root, "main")).read_metadata())
    b = block_of(mesh, LAYOUTS["rowwise"])
    for name in FLAT:
        scale = specs[f"{name}.rowwise"].component("scale")
        check("save", scale.layout == {"kind": "blocked", "block": list(flat_block(name, b))},
              f"{name}.rowwise: scale stored as {scale.layout}, not the grid of {flat_block(name, b)} blocks")


def _save_refused(root: str, mesh) -> None:
    """A column cut whose per-shard blocks form no grid (96 columns a shard, blocks of 256
    elements: a block ends part-way through a row) is refused naming the key, nothing written."""
    key, shape, placements = "optim8bit_signed.uneven", (128, 192), LAYOUTS["rowwise"]
    case, b = CASE_BY_NAME["optim8bit_signed"], block_of(mesh, placements, (128, 192))
    local = case.from_hp(cut(case.hp(7, shape), b).to(DEVICE))
    path = os.path.join(root, "refused")
    try:
        dcp.save({key: dtensor_from_local(local, mesh, placements, shape, case.dtype)}, checkpoint_id=path,
                 planner=QuantizedSavePlanner())
        check("save", False, f"{key}: per-shard blocks that form no grid were saved")
    except BaseException as e:  # noqa: BLE001
        err = qdcp_error_in(e)
        check("save", err is not None and repr(key) in str(err) and "dequantized" in str(err)
              and "blocks of 256 elements of its own" in str(err),
              f"{key}: not a clear qdcp error naming the key: {short(e)}")
    check("save", not os.path.exists(os.path.join(path, ".metadata")), f"{key}: a refused save wrote metadata")


def check_written_once(root: str, blocks: dict) -> None:
    """Replicated shards (hsdp's replicate dimension) are written once: one chunk per distinct block."""
    md = dcp.FileSystemReader(os.path.join(root, "main")).read_metadata()
    for key, bs in blocks.items():
        ours = [k for k in md.state_dict_metadata if k == key or k.startswith(key + ".__qdcp__")]
        want = len(set(bs))
        for item in ours:
            chunks = md.state_dict_metadata[item].chunks
            check("save", len(chunks) <= want, f"{item}: {len(chunks)} chunks written for {want} distinct blocks")


# ----------------------------------------------------------------------------- load

def load_into(section: str, mesh, placements, root: str) -> None:
    """Same-type, then plain targets with ``placements`` on ``mesh`` (None: whole tensors)."""
    sources = source_blocks(root)
    b = block_of(mesh, placements) if mesh is not None else (0, 0) + SHAPE
    for kind in ("same", "plain"):
        state, expect = {}, {}
        for key, srcs in sources.items():
            name = key.split(".")[0]
            case = CASE_BY_NAME[name]
            zeros = torch.zeros(b[2:], dtype=case.dtype, device=DEVICE)
            local = case.from_hp(zeros) if kind == "same" else zeros
            state[key] = dtensor_from_local(local, mesh, placements, SHAPE, case.dtype) if mesh is not None else local
            expect[key] = expected_local(name, b, srcs) if kind == "same" else cut(values(name, srcs), b)
        try:
            dcp.load(state, checkpoint_id=os.path.join(root, "main"), planner=QuantizedLoadPlanner())
        except BaseException as e:  # noqa: BLE001
            check(section, False, f"{kind} targets: the load failed: {short(e)}")
            continue
        for key, t in state.items():
            diff = components_diff(to_device(t._local_tensor if mesh is not None else t, "cpu"), expect[key])
            check(section, diff is None, f"{kind} {key} block {b} at {WORLD} ranks: {diff}")


def load_same(root: str, _mesh) -> None:
    mesh = mesh2d()
    for layout, placements in LAYOUTS.items():
        load_into(f"same-{layout}", mesh, placements, root)


def load_fsdp(root: str, _mesh) -> None:
    load_into("fsdp", mesh1d(), (Shard(0),), root)


def load_tp(root: str, _mesh) -> None:
    mesh = mesh1d()
    load_into("tp-rows", mesh, (Shard(0),), root)
    load_into("tp-cols", mesh, (Shard(1),), root)


def load_other(root: str, _mesh) -> None:
    load_into("other-2d", mesh2d((1, WORLD)), (Shard(0), Shard(1)), root)


def load_single(root: str, _mesh) -> None:
    load_into("single", None, None, root)


def replicas(root: str, _mesh) -> None:
    """HSDP replicas that diverged (the second replica group's weights moved): reported by
    ``check_replicas=True`` naming the keys and ranks, before anything is written."""
    mesh = mesh2d()
    dp = mesh.get_coordinate()[0]
    placements = LAYOUTS["hsdp"]
    b = block_of(mesh, placements)
    case = CASE_BY_NAME["int8_row"]
    for diverged in (False, True):
        full = hp("int8_row") + (1 if diverged and dp == 1 else 0)
        plain = full.float() + (1 if diverged and dp == 1 else 0)
        state = {"w": dtensor_from_local(case.from_hp(cut(full, b).to(DEVICE)), mesh, placements, SHAPE, case.dtype),
                 "p": dtensor_from_local(cut(plain, b).to(DEVICE), mesh, placements, SHAPE, torch.float32)}
        path = os.path.join(root, f"replicas-{diverged}")
        try:
            dcp.save(state, checkpoint_id=path, planner=QuantizedSavePlanner(check_replicas=True))
            err = None
        except BaseException as e:  # noqa: BLE001
            err = qdcp_error_in(e)
            check("replicas", err is not None, f"not a qdcp error: {short(e)}")
        if not diverged:
            check("replicas", err is None, f"equal replicas refused: {err}")
            continue
        msg = str(err)
        want = ["'w' (component 'qdata')", "'w' (component 'scale')", "'p'", "[0, 0] of rank(s) [2]",
                "[64, 0] of rank(s) [3]"]
        check("replicas", type(err).__name__ == "ReplicaMismatchError" and all(w in msg for w in want),
              f"the error does not name every diverged key and rank: {msg}")
        check("replicas", not os.path.exists(os.path.join(path, ".metadata")), "a refused save wrote its metadata")
        # without the check, DCP writes one replica's copy and says nothing
        dcp.save(state, checkpoint_id=path + "-unchecked", planner=QuantizedSavePlanner())
        check("replicas", os.path.exists(os.path.join(path + "-unchecked", ".metadata")), "the unchecked save failed")


COMMANDS = {"save": save, "replicas": replicas, "load-same": load_same, "load-fsdp": load_fsdp, "load-tp": load_tp,
            "load-other": load_other, "load-single": load_single}

if __name__ == "__main__":
    sys.exit(run(COMMANDS, lambda: init_torchrun_mesh(DEVICE)))
