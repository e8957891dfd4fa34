"""The ``treepack`` command line: ``stats`` and ``verify``."""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

PROGRESS_MIN_BYTES = 8 << 20  # files at least this large show a progress bar

BUILTIN_DESCRIPTION = (
    "built-in agentic batch: 4 GRPO groups x 8 rollouts, 4 prompts x 4 trajectories x 4 "
    "agent steps with tool outputs"
)


class InputError(Exception):
    """A problem with the user's input file, reported as ``FILE:LINE: message``."""


def _ids_from_line(value, where: str) -> np.ndarray:
    ids = value.get("input_ids") if isinstance(value, dict) else value
    if not isinstance(ids, list):
        got = "an object without 'input_ids'" if isinstance(value, dict) else type(value).__name__
        raise InputError(f"{where}: expected a list of token ids or an object with "
                         f"'input_ids', got {got}")
    if not ids:
        raise InputError(f"{where}: the sequence is empty; every sequence needs a token")
    if any(type(x) is not int for x in ids):
        bad = next(x for x in ids if type(x) is not int)
        raise InputError(f"{where}: token ids must be integers, found {bad!r}")
    arr = np.asarray(ids, dtype=np.int64)
    if arr.min() < 0:
        raise InputError(f"{where}: token ids must be >= 0, found {int(arr.min())}")
    return arr


def read_jsonl(path: str) -> list[np.ndarray]:
    """Sequences from a JSON-lines file: each line a list of ids or ``{"input_ids": [...]}``.

    Blank lines are skipped; any other bad line raises :class:`InputError` naming it.
    """
    from tqdm import tqdm

    try:
        size = os.path.getsize(path)
        f = open(path, "rb")
    except OSError as e:
        raise InputError(f"{path}: cannot read ({e.strerror})") from None
    out = []
    with f, tqdm(total=size, unit="B", unit_scale=True, desc=f"reading {os.path.basename(path)}",
                 disable=size < PROGRESS_MIN_BYTES, file=sys.stderr) as bar:
        for number, line in enumerate(f, start=1):
            bar.update(len(line))
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                value = json.loads(line)
            except ValueError as e:
                raise InputError(f"{where}: not valid JSON ({e})") from None
            out.append(_ids_from_line(value, where))
    if not out:
        raise InputError(f"{path}: no sequences (the file has no non-blank line)")
    return out


def _stats(args) -> int:
    import treepack
    from treepack.synthetic import agentic_batch

    if args.file is None:
        sequences, source = agentic_batch(), BUILTIN_DESCRIPTION
    else:
        sequences, source = read_jsonl(args.file), args.file
    st = treepack.forest_stats(sequences)
    result = {
        "source": source,
        "num_sequences": st.num_sequences,
        "original_tokens": st.original_tokens,
        "packed_tokens": st.packed_tokens,
        "token_ratio": st.token_ratio,
        "attention_pairs_ratio": st.attention_ratio,
        "packed_attention_pairs": st.packed_attention_pairs,
        "unpacked_attention_pairs": st.unpacked_attention_pairs,
        "trees": st.trees,
    }
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"treepack stats: {source}")
    rows = [
        ("sequences", f"{st.num_sequences:,}", ""),
        ("original tokens", f"{st.original_tokens:,}", ""),
        ("packed rows", f"{st.packed_tokens:,}", f"one per distinct prefix, in {st.trees:,} tree{'s' * (st.trees != 1)}"),
        ("token ratio", f"{st.token_ratio:.3f}",
         f"packed / original: {1 / st.token_ratio:.2f}x fewer rows"),
        ("attention pairs ratio", f"{st.attention_ratio:.3f}",
         "visible query-key pairs, packed / unpacked"),
    ]
    for name, value, note in rows:
        print(f"  {name:<22}{value:>14}   {note}".rstrip())
    return 0


DTYPES = ("float64", "float32", "bfloat16", "float16")


def _verify(args) -> int:
    import torch

    from treepack import zoo
    from treepack.verification import verification_batch, verify

    dtype = getattr(torch, args.dtype)
    # Low-precision runs are compared against float32 copies: build the model in float32.
    build = dtype if dtype in (torch.float64, torch.float32) else torch.float32
    model = zoo.tiny_model(args.family, layers=args.layers, seed=args.seed, dtype=build).eval()
    sequences = verification_batch(zoo.VOCAB, seed=args.seed)
    try:
        report = verify(model, sequences, backend=args.backend, dtype=dtype,
                        pad_to_multiple_of=args.pad_to_multiple_of)
    except (RuntimeError, ValueError, NotImplementedError) as e:
        raise InputError(str(e)) from None
    print(report)
    return 0 if report.passed else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="treepack",
        description="Exact prefix-tree packing for LLM training on prefix-sharing data.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    stats = sub.add_parser(
        "stats",
        help="what packing a batch into a prefix forest saves",
        description="Token and attention savings of packing FILE (JSON lines: a list of "
        "token ids or an object with 'input_ids' per line) into one prefix forest. Without "
        "FILE: a built-in synthetic agentic batch.",
    )
    stats.add_argument("file", nargs="?", metavar="FILE.jsonl")
    stats.add_argument("--json", action="store_true", help="print one JSON object")
    stats.set_defaults(run=_stats)

    from treepack.attention import BACKENDS
    from treepack.zoo import FAMILIES

    verify = sub.add_parser(
        "verify",
        help="packed vs unpacked equivalence of one training step on a tiny random model",
        description="Build a tiny random model of FAMILY, run one training step (loss, "
        "backward, AdamW) packed and with every sequence alone, and compare log-probs, loss, "
        "gradients and parameters. Exit status 1 when above tolerance.",
    )
    verify.add_argument("--family", required=True, choices=sorted(FAMILIES))
    verify.add_argument("--layers", type=int, default=2)
    verify.add_argument("--backend", default="segment", choices=sorted(BACKENDS))
    verify.add_argument("--dtype", default="float32", choices=DTYPES)
    verify.add_argument("--seed", type=int, default=0)
    verify.add_argument("--pad-to-multiple-of", type=int, default=None)
    verify.set_defaults(run=_verify)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except InputError as e:
        print(f"treepack {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
