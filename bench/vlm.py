"""Vision-language GRPO and a screenshot agent on a tree: one training step, tree vs padded vs
padding-free, side by side in one run, with the FLOP-ratio limit (vision tower included) and
the vision tower's share of the step.

    python bench/vlm.py              # the measurement (CPU: ~4 min on 2 cores)
    python bench/vlm.py --quick      # small shapes, a check that it runs (~30 s)
    python bench/vlm.py --device cuda --json out.json      # bench/gpu.py's "vlm" part

The model: a Qwen2-VL of random weights, text hidden 256, 4 layers, GQA 8 / 2 heads, vocabulary
4,096; a vision tower of depth 4, width 128, 2x2 patches merged 2x2 into one token (an image
of h x w patches is h*w/4 placeholder tokens). Float32 (bfloat16 on CUDA).

Workloads (ragged, as RL makes them):

- ``grpo``: 4 prompts x 8 rollouts; each prompt 48 text tokens and 1-4 images of 64-196 tokens
  (16-28 patches a side), completions of 32-160 tokens;
- ``agent``: one trajectory of 6 turns over a 96-token system prompt; each turn a 144-token
  screenshot, 32 tokens of tool text and a 32-96-token action; each turn's sequence repeats
  the whole history.

Layouts, one step each (forward through the model, mean NLL over every prediction, backward):

- ``tree``: ``hf.Images`` + ``images.pack()``: shared rows once, each distinct image encoded
  once;
- ``padding_free``: every sequence its own chain (``share_prefixes=False``) and every
  rollout's copy of its images encoded, as a stock trainer encodes them (the copies are made
  distinct by a 1e-6 change, so nothing is deduplicated): padding-free packing's work;
- ``padded``: the model's own batched forward, right-padded, ``pixel_values`` of every copy.

The FLOP-ratio limit is tree / padding-free work, with work = 2 x parameters x tokens for the
text (rows) and for the vision tower (patches), attention's quadratic term left out. The
vision share is the time of the vision tower's forward (hooks) over the whole step.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from treepack import TreePack, hf  # noqa: E402
from treepack.adapters.hf.vision import _visual  # noqa: E402
from treepack.face.benchmark.timing import Spread, interleave, ratio, synced  # noqa: E402

IMAGE, START, END = 4000, 4001, 4002
PATCH_DIM = 3 * 2 * 2 * 2  # channels x temporal patch x a 2x2 patch


def build_model(device, dtype):
    import transformers

    config = transformers.Qwen2VLConfig(
        text_config=dict(vocab_size=4096, hidden_size=256, intermediate_size=512,
                         num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                         max_position_embeddings=32768, bos_token_id=1, eos_token_id=2,
                         pad_token_id=0,
                         rope_scaling={"type": "mrope", "mrope_section": [4, 6, 6]}),
        vision_config=dict(depth=4, embed_dim=128, hidden_size=256, num_heads=4,
                           patch_size=2, spatial_merge_size=2, temporal_patch_size=2,
                           in_channels=3),
        image_token_id=IMAGE, video_token_id=4003, vision_start_token_id=START,
        vision_end_token_id=END)
    torch.manual_seed(0)
    model = transformers.Qwen2VLForConditionalGeneration(config).to(device=device, dtype=dtype)
    return hf.prepare(model.train())


def workloads(quick: bool, seed: int = 0) -> dict:
    """{name: (sequences, pixel_values, image_grid_thw)}: each sequence's images in order."""
    rng = np.random.default_rng(seed)
    div = 4 if quick else 1

    def image(side=None):
        """Pixels of one image of h x w patches (even: the 2x2 merge), and its grid."""
        h, w = (side, side) if side else (int(v) * 2 for v in rng.integers(8, 15, 2))
        if quick:
            h, w = max(4, h // 4 * 2), max(4, w // 4 * 2)
        g = torch.Generator().manual_seed(int(rng.integers(1 << 30)))
        return torch.randn(h * w, PATCH_DIM, generator=g), [1, h, w]

    def text(n):
        return rng.integers(3, 3999, max(1, n // div)).tolist()

    def placed(img):
        return [START] + [IMAGE] * (img[1][1] * img[1][2] // 4) + [END]

    out = {}
    seqs, pixels, grids = [], [], []
    for _ in range(4):
        images = [image() for _ in range(int(rng.integers(1, 5)))]
        prompt = text(16) + sum((placed(i) + text(8) for i in images), []) + text(16)
        for _ in range(8):
            seqs.append(prompt + text(int(rng.integers(32, 161))))
            for px, grid in images:
                pixels.append(px)
                grids.append(grid)
    out["grpo"] = (seqs, pixels, grids)
    seqs, pixels, grids, history, shots = [], [], [], text(96), []
    for _ in range(6):
        shot = image(24)  # a 144-token screenshot
        shots.append(shot)
        history = history + placed(shot) + text(32) + text(int(rng.integers(32, 97)))
        seqs.append(list(history))
        for px, grid in shots:
            pixels.append(px)
            grids.append(grid)
    out["agent"] = (seqs, pixels, grids)
    return out


def steps_for(model, seqs, pixels, grids, device):
    """The three steps of one workload, and their work (rows, patches)."""
    grid = torch.tensor(grids, device=device)  # as a processor's output moved to the model
    px = torch.cat(pixels).to(device)
    images = hf.Images(model, seqs, pixel_values=px, image_grid_thw=grid)
    tree = images.pack(device=device)
    # padding-free: each copy its own image (a 1e-6 change), every sequence its own chain
    noise = torch.cat([torch.full_like(p, 1e-6 * i) for i, p in enumerate(pixels)]).to(device)
    copies = hf.Images(model, seqs, pixel_values=px + noise, image_grid_thw=grid)
    flat = TreePack.from_sequences(seqs, share_prefixes=False, keys=copies.keys, device=device)
    count = sum(len(s) - 1 for s in seqs)

    def packed(pack, imgs):
        def step():
            out = hf.logprobs(model, pack, images=imgs)
            loss = -(out.logprobs * pack.prediction_mask).sum() / count
            loss.backward()
            return loss.detach()
        return step

    longest = max(map(len, seqs))
    ids = torch.zeros(len(seqs), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for s, seq in enumerate(seqs):
        ids[s, :len(seq)] = torch.tensor(seq)
        mask[s, :len(seq)] = 1
    ids, mask = ids.to(device), mask.to(device)

    def padded():
        out = model(input_ids=ids, attention_mask=mask, pixel_values=px, image_grid_thw=grid,
                    mm_token_type_ids=(ids == IMAGE).long(), use_cache=False)
        logp = out.logits[:, :-1].float().log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]
        loss = -(logp * mask[:, 1:]).sum() / count
        loss.backward()
        return loss.detach()

    patches = int(grid.prod(-1).sum())
    distinct = int(images.grid.prod(-1).sum())
    work = {"tree": (tree.num_packed_rows, distinct), "padding_free": (flat.num_packed_rows,
                                                                       patches),
            "padded": (ids.numel(), patches)}
    return {"tree": packed(tree, images), "padding_free": packed(flat, copies),
            "padded": padded}, work, images


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json")
    args = parser.parse_args()
    device = torch.device(args.device)
    model = build_model(device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    visual = _visual(model)
    text_params = sum(p.numel() for n, p in model.named_parameters() if "visual" not in n)
    vision_params = sum(p.numel() for p in visual.parameters())
    spent = {"t": 0.0}
    visual.register_forward_pre_hook(lambda m, a: spent.__setitem__("start", time.perf_counter()))
    visual.register_forward_hook(lambda m, a, o: spent.__setitem__(
        "t", spent["t"] + time.perf_counter() - spent["start"]))
    result = {"device": str(device), "quick": args.quick, "workloads": {}}
    for name, (seqs, pixels, grids) in workloads(args.quick).items():
        steps, work, images = steps_for(model, seqs, pixels, grids, device)
        steps = {k: synced(v, device) for k, v in steps.items()}
        losses = {k: float(v()) for k, v in steps.items()}  # warm-up; the same loss
        model.zero_grad()
        vision = {k: [] for k in steps}
        total = {k: [] for k in steps}

        def around(k):
            import contextlib

            @contextlib.contextmanager
            def measure():
                spent["t"] = 0.0
                t = time.perf_counter()
                yield
                total[k].append(time.perf_counter() - t)
                vision[k].append(spent["t"])
                model.zero_grad()
            return measure()

        times = interleave(steps, args.repeats, around=around)
        flops = {k: 2 * (rows * text_params + patches * vision_params)
                 for k, (rows, patches) in work.items()}
        limit = flops["tree"] / flops["padding_free"]
        row = {"sequences": len(seqs), "images": sum(map(len, images.images_of)),
               "distinct_images": images.num_images, "work": work, "loss": losses,
               "flop_limit": limit,
               "tree/padding_free": ratio(times, "tree", "padding_free")._asdict(),
               "tree/padded": ratio(times, "tree", "padded")._asdict(),
               "vision_share": {k: float(np.median(np.array(vision[k]) / np.array(total[k])))
                                for k in steps},
               "seconds": {k: float(np.median(v)) for k, v in times.items()}}
        row["tree/padding_free over limit"] = row["tree/padding_free"]["median"] / limit
        result["workloads"][name] = row
        tp, tpad = Spread(**row["tree/padding_free"]), Spread(**row["tree/padded"])
        print(f"{name}: {len(seqs)} sequences, {row['images']} images ({images.num_images} "
              f"distinct); rows tree {work['tree'][0]}, padding-free {work['padding_free'][0]},"
              f" padded {work['padded'][0]}; patches encoded tree {work['tree'][1]}, others "
              f"{work['padding_free'][1]}")
        print(f"  tree / padding_free {tp.median:.3f} [{tp.low:.3f}, {tp.high:.3f}]   "
              f"FLOP limit {limit:.3f}   over the limit {row['tree/padding_free over limit']:.2f}")
        print(f"  tree / padded       {tpad.median:.3f} [{tpad.low:.3f}, {tpad.high:.3f}]")
        print("  vision tower share of the step: " + ", ".join(
            f"{k} {v:.2f}" for k, v in row["vision_share"].items()))
        print("  seconds " + ", ".join(f"{k} {v:.3f}" for k, v in row["seconds"].items())
              + "; loss " + ", ".join(f"{k} {v:.5f}" for k, v in losses.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
