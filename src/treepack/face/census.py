"""A census of every family a user may bring: each model type of the installed transformers'
causal-LM mapping, built tiny and random, run in float64 on a tree pack and compared with every
sequence alone (:func:`treepack.verify`: log-probs and every gradient), and put in one class
(the image-text-to-text mapping likewise, each model with the images of
:func:`treepack.face.verification.verification_image_batch`):

- ``exact``: it verifies;
- ``refused``: treepack refuses it, and says why (:class:`treepack.hf.UnsupportedModel`);
- ``not built``: its config cannot be made tiny here, or its model does not build (why);
- ``wrong``: treepack accepts it and the tree differs from every sequence alone (silently
  wrong: what must never happen);
- ``crash``: an error that is not a refusal, from treepack's path;
- ``hang``: no answer within the timeout.

Each family runs in a process of its own, with a timeout, so a hang or a crash of one cannot
stop the others. ``treepack verify --all`` runs it; docs/models.md carries its table.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import subprocess
import sys
from dataclasses import dataclass

__all__ = ["Outcome", "families", "image_families", "run_one", "census", "table", "CLASSES",
           "MAX_PARAMETERS", "MAPPINGS"]

CLASSES = ("exact", "refused", "not built", "wrong", "crash", "hang")
MAPPINGS = ("causal-lm", "image-text-to-text")

# Every size field a transformers config may have, made tiny; windows and chunks short enough
# that the verification batch's sequences (up to 32 tokens) cross them.
_TINY = dict(
    vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
    sliding_window=5, attention_chunk_size=5, moe_intermediate_size=32, num_experts=4,
    num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
    first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=32, qk_nope_head_dim=8,
    qk_rope_head_dim=8, v_head_dim=16, n_layer=2, n_head=4, n_embd=64, d_model=64,
    num_layers=2, ffn_dim=128, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
    decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, n_positions=256,
    pad_token_id=0, bos_token_id=1, eos_token_id=2,
    # state-space and linear-attention mixers: 8 heads of 16 over hidden 64 x expand 2
    mamba_n_heads=8, mamba_num_heads=8, mamba_d_head=16, mamba_head_dim=16, mamba_d_ssm=128,
    mamba_d_state=16, mamba_dt_rank=8,
    # sparse attention's indexer: its top-k shorter than the sequences
    index_head_dim=16, index_n_heads=16, index_topk=4,
    n_group=1, topk_group=1,  # expert groups: one, over the 4 experts
    vocab_size_per_layer_input=97, hidden_size_per_layer_input=8,  # Gemma 4's per-layer input
    emb_dim=64, n_layers=2,  # XLM's names
    attention_types=[[["global", "local"], 1]],  # GPT-Neo: one global and one local layer
)
MAX_PARAMETERS = 50_000_000  # a tiny model is far below; above, parts were left full size
_DROPOUTS = ("attention_dropout", "hidden_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop",
             "attention_probs_dropout_prob", "hidden_dropout_prob", "dropout",
             "activation_dropout")


@dataclass
class Outcome:
    """One family's class and why (the refusal, the error, the largest error)."""

    family: str
    status: str
    reason: str = ""

    def row(self) -> str:
        reason = " ".join(self.reason.split())[:300].replace("|", "/")
        return f"| {self.family} | {self.status} | {reason} |"


def families() -> list[str]:
    """The model types of the installed transformers' causal-LM mapping."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def image_families() -> list[str]:
    """The model types of the installed transformers' image-text-to-text mapping."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    return sorted(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)


def _tiny_kwargs(config_class, defaults, *, composite_part: bool = False) -> dict:
    """The keyword arguments that make ``config_class`` (``defaults``: its default instance)
    tiny; a composite model's part keeps its token ids and vocabulary (its image tokens are
    ids of that vocabulary)."""
    import inspect

    accepted = set(inspect.signature(config_class.__init__).parameters) | set(vars(defaults))
    kwargs = {k: v for k, v in _TINY.items() if k in accepted}
    for key in ("sliding_window", "attention_chunk_size"):  # shortened where the family has
        if key in kwargs and getattr(defaults, key, None) is None:  # one: none where it has
            del kwargs[key]  # none (MiniMax passes its config's window to full layers)
    if composite_part:
        for key in ("vocab_size", "pad_token_id", "bos_token_id", "eos_token_id"):
            kwargs.pop(key, None)
    if "kv_lora_rank" in accepted:  # multi-latent attention: as many key heads as queries,
        kwargs["num_key_value_heads"] = kwargs["num_attention_heads"]  # its own head sizes
        kwargs.pop("head_dim", None)
    if "rotary_dim" in accepted:  # partial rotary within the tiny heads
        kwargs["rotary_dim"] = 8
    kinds = getattr(defaults, "layer_types", None)
    if isinstance(kinds, (list, tuple)) and kinds and "layer_types" in accepted:
        kinds = list(dict.fromkeys(kinds))  # each kind of layer once, in the model's order
        kinds = kinds * 2 if len(kinds) == 1 else kinds
        kwargs.update(layer_types=kinds, num_hidden_layers=len(kinds))
    if {"attn_layer_period", "layers_block_type"} <= accepted:  # Zamba: its layer types come
        kwargs.update(num_hidden_layers=6, attn_layer_period=3,  # from a period; 2 hybrids:
                      attn_layer_offset=2, num_key_value_heads=4)  # their weights tie
    if "attn_layer_indices" in accepted and getattr(defaults, "attn_layer_indices", 0) is None:
        kwargs["attn_layer_indices"] = [1]  # a hybrid with attention too (Bamba: none)
    if "expand" in accepted and "num_heads" in accepted:  # Mamba2: heads x head_dim fill it
        kwargs["num_heads"] = (_TINY["hidden_size"] * getattr(defaults, "expand", 2)
                               // _TINY["head_dim"])
    if "is_decoder" in accepted:
        kwargs["is_decoder"] = True  # encoders run as causal LMs only as decoders
    return kwargs


def _tiny_model(family: str, dtype, *, images: bool = False):
    """``family``'s causal LM (``images``: its image-text-to-text model, each part of its
    composite config tiny), random, in ``dtype``, dropout off."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config_class = CONFIG_MAPPING[family]
    defaults = config_class()
    parts = getattr(defaults, "sub_configs", None) or {}
    if images:
        kwargs = {}
        for name in parts:
            part = getattr(defaults, name, None)
            if part is not None and hasattr(part, "to_dict"):
                kwargs[name] = dict(_tiny_kwargs(type(part), part, composite_part=True),
                                    model_type=part.model_type)
    elif "text_config" in parts:
        raise ValueError("a composite config (text_config): built through its text model's "
                         "own type")
    else:
        kwargs = _tiny_kwargs(config_class, defaults)
    config = config_class(**kwargs)
    for c in [config] + [getattr(config, n, None) for n in parts]:
        for key in _DROPOUTS:
            if isinstance(getattr(c, key, None), float):
                setattr(c, key, 0.0)
    transformers.set_seed(0)
    auto = AutoModelForImageTextToText if images else AutoModelForCausalLM
    model = auto.from_config(config).to(dtype).eval()
    size = sum(p.numel() for p in model.parameters())
    if size > MAX_PARAMETERS:  # towers (audio, vision) whose sizes the census does not shrink
        raise ValueError(f"{size / 1e6:.0f}M parameters after the tiny sizes: parts the "
                         "census does not make tiny (verify holds several copies)")
    with torch.no_grad():  # it runs an ordinary batch, or it was not built right here
        model(input_ids=torch.tensor([[3, 4, 5, 6, 7, 8]]), use_cache=False)
    return model


def run_one(family: str, mapping: str = "causal-lm") -> Outcome:
    """``family``'s outcome, in this process (``mapping``: one of :data:`MAPPINGS`)."""
    if mapping == "image-text-to-text":
        return _run_images(family)
    from treepack.adapters import hf
    from treepack.data.zoo import VOCAB
    from treepack.face.verification import verification_batch, verify

    import torch

    model, why = None, []
    for dtype in (torch.float64, torch.float32):  # float32 where a kernel refuses float64
        try:
            model = _tiny_model(family, dtype)
            break
        except Exception as e:  # noqa: BLE001 - any failure to build is "not built", with why
            why.append(f"{str(dtype)[6:]}: {type(e).__name__}: {e}")
    if model is None:
        return Outcome(family, "not built", "; ".join(why))
    print("CENSUS-BUILT", flush=True)  # a process killed before this line was building
    sequences = verification_batch(VOCAB)
    try:
        report = verify(model, sequences)
    except hf.UnsupportedModel as e:
        return Outcome(family, "refused", str(e))
    except Exception as e:  # noqa: BLE001 - reported as a crash, never swallowed silently
        return Outcome(family, "crash", f"{type(e).__name__}: {e}")
    return _verified(family, report, dtype)


def _zoo_vision(family: str) -> str | None:
    """The key of ``treepack.zoo.VISION_FAMILIES`` whose model is of type ``family``."""
    import transformers

    from treepack.data import zoo

    return next((key for key, (name, *_) in zoo.VISION_FAMILIES.items()
                 if getattr(transformers, name).model_type == family), None)


def _run_images(family: str) -> Outcome:
    """``family``'s image-text-to-text outcome: the families whose images treepack runs are
    built as ``treepack.zoo`` builds them (their towers tiny, the batch's pixels laid out for
    them) and verified with images; any other is built tiny from its defaults and meets what a
    user's would: ``hf.prepare``, then the images' check (:class:`treepack.hf.Images`)."""
    import torch

    from treepack.adapters import hf
    from treepack.data import zoo
    from treepack.adapters.hf.vision import check_family
    from treepack.face.verification import verification_image_batch, verify

    key = _zoo_vision(family)
    model, why = None, []
    for dtype in (torch.float64, torch.float32):  # float32 where a kernel refuses float64
        try:
            model = (zoo.tiny_vision_model(key, dtype=dtype) if key else
                     _tiny_model(family, dtype, images=True))
            break
        except Exception as e:  # noqa: BLE001 - any failure to build is "not built", with why
            why.append(f"{str(dtype)[6:]}: {type(e).__name__}: {e}")
    if model is None:
        return Outcome(family, "not built", "; ".join(why))
    print("CENSUS-BUILT", flush=True)
    try:
        if key is None:
            hf.prepare(model)  # the language model's checks, then the images'
            check_family(model)
            return Outcome(family, "not built", "treepack runs its images, but the census lays "
                                                "out images for treepack.zoo's families only")
        batch = verification_image_batch(key, dtype=dtype)
        images = hf.Images(model, batch.sequences, pixel_values=batch.pixel_values,
                           image_grid_thw=batch.image_grid_thw)
        report = verify(model, batch.sequences, images=images)
    except hf.UnsupportedModel as e:
        return Outcome(family, "refused", str(e))
    except Exception as e:  # noqa: BLE001 - reported as a crash, never swallowed silently
        return Outcome(family, "crash", f"{type(e).__name__}: {e}")
    return _verified(family, report, dtype)


def _verified(family: str, report, dtype) -> Outcome:
    import torch

    measured = ", ".join(f"{q} {report.errors[q].max_rel:.1e}" for q in ("logprobs", "grads"))
    measured += "" if dtype == torch.float64 else " (float32: a kernel refuses float64)"
    if report.passed:
        return Outcome(family, "exact", measured)
    return Outcome(family, "wrong", measured + " (over the allowance)")


def _child(family: str, timeout: float, mapping: str = "causal-lm") -> Outcome:
    """``family`` in a process of its own, within ``timeout`` seconds."""
    code = ("import json, warnings; warnings.filterwarnings('ignore')\n"
            "from treepack.face.census import run_one\n"
            f"o = run_one({family!r}, {mapping!r})\n"
            "print('CENSUS-ANSWER' + json.dumps([o.family, o.status, o.reason]))\n")
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=timeout, env=env)
    except subprocess.TimeoutExpired as e:
        seen = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        if "CENSUS-BUILT" not in seen:  # its default-size parts take that long to build
            return Outcome(family, "not built", f"building the model took over {timeout:.0f} s")
        return Outcome(family, "hang", f"no answer within {timeout:.0f} s")
    for line in done.stdout.splitlines():
        if line.startswith("CENSUS-ANSWER"):
            return Outcome(*json.loads(line[len("CENSUS-ANSWER"):]))
    tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
    if "CENSUS-BUILT" not in done.stdout:  # killed (out of memory) or failed while building
        return Outcome(family, "not built", f"the process ended while building the model "
                                            f"(exit {done.returncode}): {tail[0]}")
    return Outcome(family, "crash", f"exit {done.returncode}: {tail[0]}")


def census(names: list[str] | None = None, *, timeout: float = 120.0,
           workers: int = 2, mapping: str = "causal-lm") -> list[Outcome]:
    """Every family's :class:`Outcome` (``names``: these, else every family of ``mapping``:
    :func:`families` or :func:`image_families`)."""
    if mapping not in MAPPINGS:
        raise ValueError(f"mapping {mapping!r} is not one of {MAPPINGS}")
    if names is None:
        names = families() if mapping == "causal-lm" else image_families()
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        return list(pool.map(lambda f: _child(f, timeout, mapping), names))


def table(outcomes: list[Outcome], mapping: str = "causal-lm") -> str:
    """The census as a markdown table, with the count of each class first."""
    import transformers

    counts = {c: sum(o.status == c for o in outcomes) for c in CLASSES}
    head = (f"transformers {transformers.__version__}, {mapping}: {len(outcomes)} families: "
            + ", ".join(f"{n} {c}" for c, n in counts.items()))
    rows = "\n".join(o.row() for o in outcomes)
    return f"{head}\n\n| family | status | reason |\n|---|---|---|\n{rows}\n"
