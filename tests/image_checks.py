"""The scaffolding the image tests share (registered by conftest as ``specray_test_image_checks``): tiny random
images, a checkpoint's config with fields changed, each image's embeddings from a checkpoint's encoder, our text
model's logits over a prompt with images' rows (and multimodal positions) chunk by chunk, the check that two ranks
(tensor parallel or two pipeline stages) give one rank's logits there, and for the Qwen-VL-style releases (pixels and
a grid per image) the processor's expansion and transformers' logits. Imports at the top only torch, numpy and
specray: the ranks' processes load this module by its path."""

from __future__ import annotations

import json
import os
import pickle
import random
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
import torch

from specray.models.attention import build_attention_metadata
from specray.models.kv_cache import allocate_kv_cache, allocate_recurrent_state
from specray.multimodal import step_rows

BLOCK = 4


def random_images(shapes, legacy: bool = False) -> list:
    """One random RGB image per ``(height, width)`` (or ``(height, width, 3)``) in ``shapes``, seed 0: numpy's
    ``default_rng`` over 0-255, or (``legacy``) ``RandomState.randint`` over 0-254 as the older tests drew them."""
    from PIL import Image

    if legacy:
        rng = np.random.RandomState(0)
        return [Image.fromarray(rng.randint(0, 255, (*s[:2], 3), dtype=np.uint8)) for s in shapes]
    rng = np.random.default_rng(0)
    return [Image.fromarray(rng.integers(0, 256, (*s[:2], 3), dtype=np.uint8)) for s in shapes]


def config_with(folder: Path, **changes):
    """The checkpoint's config (``read_config``) with ``changes`` set; a ``__`` in a name walks into a sub-config
    (``vision_config__hidden_act``)."""
    from specray.models.loader import read_config

    config = read_config(str(folder))
    for name, value in changes.items():
        target = config
        *path, last = name.split("__")
        for part in path:
            target = getattr(target, part)
        setattr(target, last, value)
    return config


def rope_table(mm, total: int) -> torch.Tensor:
    """[3, total]: the prompt's positions, then slot + delta on every axis for the tokens past it."""
    prompt = torch.tensor(mm.rope_positions)
    past = torch.arange(prompt.shape[1], total) + mm.rope_delta
    return torch.cat((prompt, past.expand(3, -1)), dim=1)


def encode_items(encoder, mm) -> list[torch.Tensor]:
    """Each image item's embeddings from ``encoder`` (its processed tensors as they are)."""
    with torch.no_grad():
        return [encoder.encode({k: torch.from_numpy(v) for k, v in item.data.items()}) for item in mm.items]


def encoded(folder: Path, mm, edit=None) -> list[torch.Tensor]:
    """Each image item's embeddings from the checkpoint's encoder, built and loaded as the engine's loader does
    (``edit``: a change made to it before it encodes)."""
    from specray.models.loader import load_image_encoder, read_config

    encoder = load_image_encoder(str(folder), read_config(str(folder)), torch.float32, "cpu")
    if edit is not None:
        with torch.no_grad():
            edit(encoder)
    return encode_items(encoder, mm)


# ---- the Qwen-VL-style releases (flattened patches and a grid per image) ---------------------------------------------

def assert_expansion_equals_transformers(theirs, processor, cases: list[tuple], hf=None, generated: list[int] = (),
                                         types_from_ids: bool = False) -> None:
    """For each ``(text, images)`` of ``cases``, our expanded prompt, item lengths (t*h*w / merge² of 2 x 2), pixels
    and grids equal transformers' processor ``theirs``'. With ``hf`` (its whole model), our multimodal RoPE positions
    equal its ``get_rope_index`` over the prompt and ``generated`` (slot + delta there, a negative delta), the token
    types as transformers' processor gives them (``types_from_ids``: the prompt's image tokens); without, the
    processor gives no multimodal positions."""
    from specray.multimodal import expand_prompt

    for text, pictures in cases:
        want = theirs(text=[text], images=pictures, return_tensors="pt")
        ids, mm = expand_prompt(theirs.tokenizer(text)["input_ids"], pictures, processor)
        assert ids == want["input_ids"][0].tolist()
        assert [item.length for item in mm.items] == [int(g.prod()) // 4 for g in want["image_grid_thw"]]
        assert np.array_equal(np.concatenate([i.data["pixel_values"] for i in mm.items]), want["pixel_values"].numpy())
        assert np.array_equal(np.concatenate([i.data["image_grid_thw"] for i in mm.items]), want["image_grid_thw"])
        if hf is None:
            assert mm.rope_positions is None
            continue
        full = torch.tensor([ids + list(generated)])
        if types_from_ids:
            types = full == processor.image_token_id
        else:
            types = torch.cat((want["mm_token_type_ids"], torch.zeros(1, len(generated), dtype=torch.long)), dim=1)
        positions, delta = hf.model.get_rope_index(full, types.int(), image_grid_thw=want["image_grid_thw"])
        assert torch.equal(rope_table(mm, full.shape[1]), positions[:, 0])
        assert mm.rope_delta == int(delta) < 0


@torch.no_grad()
def grid_reference(hf, ids: list[int], mm, token_types: bool = True) -> torch.Tensor:
    """transformers' whole model's logits [L, V] over ``ids`` with the images' processed tensors (pixels and grids
    concatenated; ``token_types``: ``mm_token_type_ids`` marking the image tokens)."""
    data = [item.data for item in mm.items]
    input_ids = torch.tensor([ids])
    pixels = torch.from_numpy(np.concatenate([d["pixel_values"] for d in data]))
    grid = torch.from_numpy(np.concatenate([d["image_grid_thw"] for d in data]))
    if not token_types:
        return hf(input_ids=input_ids, pixel_values=pixels, image_grid_thw=grid).logits[0]
    types = (input_ids == hf.config.image_token_id).int()
    return hf(input_ids=input_ids, pixel_values=pixels, image_grid_thw=grid, mm_token_type_ids=types).logits[0]


@torch.no_grad()
def image_logits(model, ids: list[int], mm, embeds: list[torch.Tensor], sizes: list[int] | None,
                 rope: torch.Tensor | None = None, forget: bool = False, bidirectional: bool = False,
                 blocks: int = 64) -> torch.Tensor | None:
    """Our text model's logits [L, V] over ``ids`` (the expanded prompt and tokens past it) in chunks of ``sizes``
    (then single steps; None: one prefill) through a paged cache in ``blocks`` shuffled blocks, each chunk's image
    rows from ``embeds`` as the runner hands them: [n, H] (``meta.input_embeds``), [1 + k, n, H] (the first as
    ``meta.input_embeds``, the rest as ``meta.deepstack_embeds``) or an encoder of discrete codes' ids [n] (written
    over the chunk's ids). Positions: ``rope`` where given, else
    :func:`rope_table` where the processor gives multimodal positions, else plain ones. A model with linear-attention
    layers keeps their state in a slot (``forget``: every chunk starts it afresh, a mistake); ``bidirectional``: the
    tokens of an image span attend to each other both ways (Gemma 3). None on a pipeline stage before the last."""
    from specray.models.gated_deltanet import RecurrentBatch

    if rope is None and mm.rope_positions is not None:
        rope = rope_table(mm, len(ids))
    sizes = [len(ids)] if sizes is None else sizes + [1] * (len(ids) - sum(sizes))
    allocate_kv_cache(model, blocks, BLOCK)
    recurrent = allocate_recurrent_state(model, 2, 4) is not None
    table = random.Random(0).sample(range(blocks), -(-len(ids) // BLOCK))
    out, start = [], 0
    for n in sizes:
        ancestors = None
        if bidirectional:
            anc = torch.ones(n, n, dtype=torch.bool).tril()
            for item in mm.items:
                if start <= item.offset < start + n:
                    anc[item.offset - start:item.end - start, item.offset - start:item.end - start] = True
            ancestors = [anc]
        meta = build_attention_metadata([n], [start], [table], BLOCK, model.device, ancestors=ancestors)
        if recurrent:
            meta.recurrent = RecurrentBatch([1], [start == 0 or forget], [0], [0])
        rows, values = [], []
        for item, embed in zip(mm.items, embeds):
            positions, indices = step_rows(item, start, start + n)
            rows += [p - start for p in positions]
            values.append(embed[:, indices] if embed.dim() == 3 else embed[indices])
        chunk = list(ids[start: start + n])
        if rows and not values[0].is_floating_point():  # an image's codes: the prompt's own tokens
            for row, code in zip(rows, torch.cat(values).tolist()):
                chunk[row] = code
        elif rows:
            if values[0].dim() == 3:
                stacked = torch.cat(values, dim=1).to(model.device)
                meta.input_embeds = (torch.tensor(rows, device=model.device), stacked[0])
                meta.deepstack_embeds = stacked[1:]
            else:
                meta.input_embeds = (torch.tensor(rows, device=model.device), torch.cat(values).to(model.device))
        if rope is not None:
            meta.rope_positions = rope[:, start: start + n].to(model.device)
        hidden = model(torch.tensor(chunk, device=model.device), meta)
        out.append(None if hidden is None else model.compute_logits(hidden))
        start += n
    return None if out[0] is None else torch.cat(out)


# ---- two ranks against one -------------------------------------------------------------------------------------------

# one rank of two (run_ranks' arguments: rank, stages (1: tensor parallel, 2: two pipeline stages), port, the result's
# folder, then one pickle per run of (checkpoint folder, ids, MultiModalInputs, chunk sizes, image_logits' options)):
# each checkpoint's encoder (whole on each rank) embeds the images, the text model's share on this rank runs
# image_logits (this module, loaded by its path), and the rank writes how far its logits are from one rank's (None on
# the first of two stages)
RANK_WORKER = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("image_checks", %r)
checks = importlib.util.module_from_spec(spec)
spec.loader.exec_module(checks)
checks.rank_main(sys.argv[1:])
""" % str(Path(__file__).resolve())


def rank_main(argv: list[str]) -> None:
    """:data:`RANK_WORKER`'s body."""
    import gc

    import torch.distributed as dist

    from specray.models.loader import load_image_encoder, load_model, read_config
    from specray.workers.worker import join_groups

    torch.set_num_threads(1)
    rank, stages, port, out, *runs = argv
    tp, pp = join_groups(torch.device("cpu"), int(rank), 2, f"tcp://127.0.0.1:{port}", int(stages))
    diffs = []
    for run in runs:
        folder, ids, mm, sizes, options = pickle.loads(Path(run).read_bytes())
        embeds = encode_items(load_image_encoder(folder, read_config(folder), torch.float32, "cpu"), mm)
        # (``first_stage_deepstack``: the runner hands the DeepStack features [1:] to the first stage only)
        mine = [e[:1] for e in embeds] if options.pop("first_stage_deepstack", False) and not pp.is_first else embeds
        ours = image_logits(load_model(folder, tp, pp=pp), ids, mm, mine, sizes, **options)
        one = None if ours is None else image_logits(load_model(folder), ids, mm, embeds, sizes, **options)
        # (equal entries count 0: a pruned vocabulary's -inf logits, Apertus 1.5's, are equal, not NaN apart)
        diffs.append(None if ours is None else torch.where(ours == one, 0.0, (ours - one).abs()).max().item())
    gc.collect()
    dist.destroy_process_group()
    Path(out, f"{rank}.json").write_text(json.dumps({"diffs": diffs}))


def assert_ranks_equal_one_rank(tmp_path: Path, runs: list[tuple], stages: int, tol: float) -> None:
    """:data:`RANK_WORKER` over two ranks, one per entry of ``runs``: ``(folder, ids, mm, sizes)`` or ``(folder, ids,
    mm, sizes, options)`` (:func:`image_logits`' keywords, and ``first_stage_deepstack``: a later pipeline stage is
    handed each image's rows alone, as the runner does). ``stages`` 1: two tensor-parallel ranks, each run's
    logits on both within ``tol`` of one rank's; 2: two pipeline stages, the first handing out none, the last's
    within ``tol``."""
    from specray_test_model_checks import run_ranks

    tmp_path.mkdir(exist_ok=True)
    paths = []
    for i, (folder, ids, mm, sizes, *options) in enumerate(runs):
        paths.append(tmp_path / f"run{i}.pkl")
        paths[-1].write_bytes(pickle.dumps((str(folder), list(ids), mm, sizes, options[0] if options else {})))
    results = run_ranks(tmp_path, RANK_WORKER, 2, stages, [str(p) for p in paths])
    assert [[d is None for d in r["diffs"]] for r in results] == [[stages == 2] * len(runs), [False] * len(runs)], \
        results
    assert all(d < tol for r in results for d in r["diffs"] if d is not None), results


def first_cut(mm, into: int = 5) -> int:
    """A prefill chunk's length that ends ``into`` tokens inside the first image's span."""
    return mm.items[0].offset + into


def prompt_run(folder: Path, text: str, images: list, first: int | None = None, **options) -> tuple:
    """A run of :func:`assert_ranks_equal_one_rank`: ``text`` (its tokenizer's ids) with ``images`` expanded by the
    checkpoint's image processor (as the engine loads it), in a prefill chunk of ``first`` tokens (None:
    :func:`first_cut`, ending inside the first image's span) and one of the rest."""
    from transformers import AutoTokenizer

    from specray.models.loader import load_image_processor
    from specray.multimodal import expand_prompt

    ids, mm = expand_prompt(AutoTokenizer.from_pretrained(folder).encode(text), images,
                            load_image_processor(str(folder)))
    first = first_cut(mm) if first is None else first
    return folder, ids, mm, [first, len(ids) - first], options


def private_env(variables: Sequence[str], module: str, what: str, stand_in: str | None = "the recorded digests"
                ) -> dict:
    """The environment of a subprocess that imports ``module`` (kept out of the venv: torchvision, torchaudio) from the
    folder the first of the environment ``variables`` set names; the test is skipped where it still does not import
    (``what``: the transformers piece that then cannot run; ``stand_in``: what the other tests check instead)."""
    env = dict(os.environ)
    extra = next((os.environ[v] for v in variables if os.environ.get(v)), None)
    if extra:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (extra, env.get("PYTHONPATH")) if p)
    if subprocess.run([sys.executable, "-c", f"import {module}"], env=env, capture_output=True).returncode:
        pytest.skip(f"{module} does not import: {what} cannot run" + (f" ({stand_in} stand in)" if stand_in else ""))
    return env
