"""treepack.verl_trainer through verl 0.9.1's real ``_balance_batch`` (v1 PPOTrainer, v0
RayPPOTrainer): batches are split as verl's dispatch splits them and cut into mini-batches as
its workers cut them, then every forward's packed rows are counted. Runs where verl is
installed (the `.venv-verl` of `.ci/run`)."""

import importlib.util
import logging
import subprocess
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("verl", reason="verl tests run in the verl environment (.ci/run)")
torch = pytest.importorskip("torch")
warnings.filterwarnings("ignore", message=".* engine is not available")

from transfer_queue import KVBatchMeta  # noqa: E402
from verl.protocol import BatchData, DataProto  # noqa: E402
from verl.trainer.ppo.ray_trainer import RayPPOTrainer  # noqa: E402
from verl.trainer.ppo.v1 import PPOTrainer  # noqa: E402

from treepack import verl_trainer  # noqa: E402
from treepack.adapters.verl import log as verl_log  # noqa: E402
from treepack.sharing import report  # noqa: E402

from tolerance import FLOAT64_OP  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
_spec = importlib.util.spec_from_file_location("verl_balance", ROOT / "bench" / "verl_balance.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)  # the benchmark's batches, trainer and counting, one copy


@pytest.fixture
def installed():
    verl_trainer.install()
    yield
    verl_trainer.uninstall()


@pytest.fixture
def stock():
    verl_trainer.uninstall()
    yield


def uid_of(key: str) -> str:
    return key.rsplit("_", 2)[0]


def split_groups(chunks) -> int:
    """Groups (uid) whose keys lie in more than one chunk."""
    where = {}
    for c, keys in enumerate(chunks):
        for k in keys:
            where.setdefault(uid_of(k), set()).add(c)
    return sum(len(s) > 1 for s in where.values())


# much worse than one rank with verl's own balancing: (a) 0.33 -> 0.73, (b) 0.86 -> 0.94
@pytest.mark.parametrize("workload,stock_at_least", [("a", 2.0), ("b", 1.05)])
def test_groups_stay_on_one_rank_and_mini_batch_as_on_one_rank(workload, stock_at_least,
                                                               installed):
    batch = bench.grpo_batch(workload)  # 256 prompts x 8, ppo_mini_batch_size 64
    one_rank = bench.token_ratio(batch, [batch.meta.keys])
    meta, metrics = bench.balance(bench.v1_trainer(8, "treepack.verl"), batch)
    assert sorted(meta.keys) == sorted(batch.meta.keys)
    got = bench.measure(batch, meta, metrics, 8)
    assert got["rank_ratio"] <= 1.05 * one_rank and got["minibatch_ratio"] <= 1.05 * one_rank
    assert got["split_ranks"] == got["split_minibatches"] == 0
    assert metrics["treepack/groups_split_ranks"] == 0
    assert metrics["treepack/groups_split_minibatches"] == 0
    # verl's numbers are there, and the token imbalance is no worse than verl's own
    # uid-keeping balancer's (measured: a 1.0002 vs 1.0000, b 1.0007 vs 1.0011 max/mean)
    group_meta, group_metrics = bench.verl_group_balanced(batch, 8)
    assert group_metrics.keys() <= metrics.keys()
    verl_groups = bench.measure(batch, group_meta, group_metrics, 8)
    assert got["max_over_mean"] <= verl_groups["max_over_mean"] + 1e-3
    verl_trainer.uninstall()  # verl's own balancing on the same batch scatters the groups
    stock_meta, stock_metrics = bench.balance(bench.v1_trainer(8, "treepack.verl"), batch)
    assert bench.measure(batch, stock_meta, stock_metrics, 8)["rank_ratio"] > \
        stock_at_least * one_rank


def test_under_ulysses_groups_stay_on_one_data_parallel_share(installed):
    """8 ranks in Ulysses groups of 2: verl's dispatch info maps ranks to 4 data-parallel
    shares (each sent to both ranks of its group), and the balancing deals whole groups to
    those 4 shares, as on 4 ranks without sequence parallelism."""
    batch = bench.grpo_batch("a")
    trainer = bench.v1_trainer(8, "treepack.verl")
    trainer.actor_rollout_wg._dispatch_info = {"actor": [r // 2 for r in range(8)]}
    meta, metrics = bench.balance(trainer, batch)
    assert sorted(meta.keys) == sorted(batch.meta.keys)
    assert split_groups([chunk.keys for chunk in meta.chunk(4)]) == 0
    assert metrics["treepack/groups_split_ranks"] == 0
    assert bench.measure(batch, meta, metrics, 4) == \
        bench.measure(batch, *bench.balance(bench.v1_trainer(4, "treepack.verl"), batch), 4)


@pytest.mark.parametrize("external_lib", [None, "my.lib", ["my.lib"]])
def test_without_treepack_in_external_lib_verl_runs_unchanged(external_lib, installed):
    batch = bench.grpo_batch("b", prompts=32)
    got = bench.balance(bench.v1_trainer(4, external_lib, mini_batch=8), batch)
    verl_trainer.uninstall()
    want = bench.balance(bench.v1_trainer(4, external_lib, mini_batch=8), batch)
    assert got[0].keys == want[0].keys and got[1] == want[1]


@pytest.mark.parametrize("external_lib", ["treepack.verl_lean",
                                          ["my.lib", "treepack.verl"]])
def test_treepack_in_external_lib_in_any_form_turns_it_on(external_lib, installed):
    batch = bench.grpo_batch("b", prompts=32)
    meta, metrics = bench.balance(bench.v1_trainer(4, external_lib, mini_batch=8), batch)
    assert metrics["treepack/groups_split_minibatches"] == 0
    assert split_groups(bench.forwards(meta, 4, 16)[0]) == 0


def test_padding_rows_are_each_a_group_of_their_own(installed):
    # 30 prompts x 8 + 16 padding rows = 256, already a multiple of lcm(8 ranks, 16 x 8):
    # verl's upsampling (which needs TransferQueue) leaves it as it is
    batch = bench.grpo_batch("a", prompts=30, padding=16)
    meta, metrics = bench.balance(bench.v1_trainer(8, "treepack.verl", mini_batch=16), batch)
    assert len(meta) == 256 and sorted(meta.keys) == sorted(batch.meta.keys)
    ranks = bench.forwards(meta, 8, 16)
    real = [[[k for k in mb if not k.startswith("pad")] for mb in r] for r in ranks]
    assert split_groups([sum(r, []) for r in real]) == 0
    assert split_groups([mb for r in real for mb in r]) == 0
    # one shared pad uid would put all 16 on one rank; as independent rows they fill the room
    # the real groups leave on several
    assert metrics["treepack/groups_split_ranks"] == 0
    assert sum(any(k.startswith("pad") for k in sum(r, [])) for r in ranks) > 1


def test_groups_without_room_are_cut_into_the_fewest_pieces_and_counted(installed):
    # 20 groups of 8 on 8 ranks of 20 rows: 16 stay whole, 4 are cut in 2 pieces each
    batch = bench.grpo_batch("b", prompts=20)
    meta, metrics = bench.balance(bench.v1_trainer(8, "treepack.verl", mini_batch=20), batch)
    ranks = [sum(r, []) for r in bench.forwards(meta, 8, 20)]
    assert metrics["treepack/groups_split_ranks"] == split_groups(ranks) == 4
    pieces = {(uid_of(k), r) for r, keys in enumerate(ranks) for k in keys}
    assert len(pieces) == 16 + 4 * 2


def test_an_agent_group_larger_than_a_rank_fills_whole_ranks(installed):
    # one prompt whose 8 sessions emit 5 outputs each (40 rows, index > 0) beside 11 GRPO
    # groups of 8: 128 rows on 4 ranks of 32
    batch = bench.grpo_batch("a", prompts=12)
    uid = uid_of(batch.meta.keys[0])
    keys = [f"{uid}_{s}_{i}" for s in range(8) for i in range(5)] + batch.meta.keys[8:]
    tags = [batch.meta.tags[0]] * 32 + batch.meta.tags
    meta = KVBatchMeta(keys=keys, tags=tags, partition_id="train")
    metrics = {}
    trainer = bench.v1_trainer(4, "treepack.verl", mini_batch=16)
    meta = trainer._balance_batch(meta, metrics=metrics)
    ranks = [sum(r, []) for r in bench.forwards(meta, 4, 32)]
    agent_ranks = {r for r, keys in enumerate(ranks) for k in keys if uid_of(k) == uid}
    assert len(agent_ranks) == 2  # ceil(40 / 32)
    assert metrics["treepack/groups_split_ranks"] == split_groups(ranks) == 1


def test_actor_shuffle_warns_once(installed, monkeypatch, caplog):
    monkeypatch.setattr(verl_log, "_SAID", set())
    batch = bench.grpo_batch("a", prompts=8)
    with caplog.at_level(logging.INFO, logger="treepack.verl"):
        for _ in range(2):
            bench.balance(bench.v1_trainer(2, "treepack.verl", mini_batch=4, shuffle=True),
                          batch)
    said = [r.getMessage() for r in caplog.records if r.name == "treepack.verl"]
    assert sum("actor.shuffle=true" in m for m in said) == 1
    assert sum("keeps each prompt's rows" in m for m in said) == 1


def v0_batch(batch, with_uid: bool) -> DataProto:
    """The batch as verl's v0 trainer holds it: left-padded prompts, right-padded responses."""
    prompt_len = np.array([t["prompt_len"] for t in batch.meta.tags])
    response_len = np.array([t["response_len"] for t in batch.meta.tags])
    width_p, width_r = prompt_len.max(), response_len.max()
    prompts = torch.zeros(len(prompt_len), width_p, dtype=torch.int64)
    for i, (ids, p) in enumerate(zip(batch.tokens, prompt_len)):
        prompts[i, width_p - p:] = torch.from_numpy(ids[:p])
    cols_p, cols_r = torch.arange(width_p), torch.arange(width_r)
    mask = torch.cat([cols_p >= torch.from_numpy(width_p - prompt_len)[:, None],
                      cols_r < torch.from_numpy(response_len)[:, None]], 1).long()
    uids = np.array([uid_of(k) for k in batch.meta.keys], dtype=object)
    input_ids = torch.zeros(mask.shape, dtype=torch.int64)
    input_ids[mask.bool()] = torch.from_numpy(np.concatenate(batch.tokens))
    return DataProto.from_dict(tensors={"attention_mask": mask, "prompts": prompts,
                                        "input_ids": input_ids,
                                        "row": torch.arange(len(uids))},
                               non_tensors={"uid": uids} if with_uid else {})


def rank_of(parts, n: int) -> np.ndarray:
    """The part each of ``n`` rows lies in, from each part's rows."""
    out = np.empty(n, dtype=np.int64)
    for j, rows in enumerate(parts):
        out[rows] = j
    return out


def v0_trainer(ranks: int, external_lib, mini_batch: int) -> RayPPOTrainer:
    trainer = object.__new__(RayPPOTrainer)
    trainer.config = bench.v1_trainer(ranks, external_lib, mini_batch=mini_batch).config
    trainer.actor_rollout_wg = SimpleNamespace(_dispatch_info={"actor": list(range(ranks))})
    return trainer


@pytest.mark.parametrize("with_uid", [True, False])
def test_v0_trainer_keeps_groups_with_or_without_uid(with_uid, installed):
    batch = bench.grpo_batch("b", prompts=32)
    uid = np.array([uid_of(k) for k in batch.meta.keys])
    data, metrics = v0_batch(batch, with_uid), {}
    assert v0_trainer(4, "treepack.verl", mini_batch=8)._balance_batch(data, metrics) is None
    chunks = BatchData(data).chunk(4)  # verl's dispatch split
    rows = [c.batch["row"].numpy() for c in chunks]
    assert sorted(np.concatenate(rows).tolist()) == list(range(len(uid)))
    minibatches = [r[i:i + 16] for r in rows for i in range(0, len(r), 16)]  # 8 x 8 / 4
    for parts in (rows, minibatches):
        assert split_groups([[f"{uid[i]}_0_0" for i in p] for p in parts]) == 0
    assert metrics["treepack/groups_split_minibatches"] == 0
    assert "global_seqlen/balanced_max" in metrics
    # the step's rows as placed: groups whole on a rank and in a mini-batch lose no rows of
    # their prompts, only what different prompts share (nothing in this batch)
    m = {k: v for k, v in metrics.items() if k.startswith("treepack/step/")}
    want = report(batch.tokens, groups=uid if with_uid else None,
                  prompt_lengths=[t["prompt_len"] for t in batch.meta.tags],
                  ranks=rank_of(rows, len(uid)), micro_batches=rank_of(minibatches, len(uid)))
    assert m == want.metrics(prefix="treepack/step/")
    assert want.lost.across_ranks == want.lost.across_micro_batches == 0
    assert want.achieved_rows < want.original_tokens


def test_v0_trainer_counts_rows_with_images_over_id_image_pairs(installed):
    """Two groups ask the same question of two images (one placeholder count, so their ids
    are equal): the step's report counts (id, image) pairs, as the workers' packs are built,
    not one shared prompt."""
    from treepack import zoo

    images = zoo.image_batch([[1, ("image", k), 5, 6] for k in (1, 2)])
    assert images.sequences[0] == images.sequences[1]
    pixels = torch.split(images.pixel_values, images.image_grid_thw.prod(-1).tolist())
    prompts, responses, uid, inputs = [], [], [], []
    for k in range(2):
        for r in range(4):
            prompts.append(images.sequences[k])
            responses.append([20 + r, 30 + r])
            uid.append(f"q{k}")
            inputs.append({"pixel_values": pixels[k],
                           "image_grid_thw": images.image_grid_thw[k:k + 1]})
    P = max(map(len, prompts))
    R = max(map(len, responses))
    ids, mask = torch.zeros(8, P + R, dtype=torch.int64), torch.zeros(8, P + R, dtype=torch.int64)
    for b, (p, c) in enumerate(zip(prompts, responses)):
        ids[b, P - len(p):P + len(c)], mask[b, P - len(p):P + len(c)] = torch.tensor(p + c), 1
    data = DataProto.from_dict(
        tensors={"attention_mask": mask, "prompts": ids[:, :P], "input_ids": ids},
        non_tensors={"uid": np.array(uid, dtype=object),
                     "multi_modal_inputs": np.array(inputs, dtype=object)})
    trainer = v0_trainer(2, "treepack.verl", mini_batch=2)
    trainer.processor = SimpleNamespace(image_token_id=zoo.VISION_IDS["image_token_id"])
    metrics = {}
    trainer._balance_batch(data, metrics)
    seqs = [p + c for p, c in zip(prompts, responses)]
    keys = [[0] * len(s) for s in seqs]
    for b, s in enumerate(seqs):  # each image's placeholders keyed by the image, by hand
        for t, tok in enumerate(s):
            if tok == zoo.VISION_IDS["image_token_id"]:
                keys[b][t] = 1 + b // 4
    by_image = report(seqs, keys=keys).achievable_ratio
    # a ratio of row counts: a float64 division each way
    assert metrics["treepack/step/achievable_ratio"] == pytest.approx(by_image, rel=FLOAT64_OP,
                                                                      abs=0)
    assert by_image > report(seqs).achievable_ratio  # over ids alone: one shared prompt


def test_v0_trainer_without_treepack_runs_unchanged(installed):
    batch = bench.grpo_batch("b", prompts=32)
    got, got_metrics = v0_batch(batch, True), {}
    v0_trainer(4, None, 8)._balance_batch(got, got_metrics)
    verl_trainer.uninstall()
    want, want_metrics = v0_batch(batch, True), {}
    v0_trainer(4, None, 8)._balance_batch(want, want_metrics)
    assert torch.equal(got.batch["row"], want.batch["row"]) and got_metrics == want_metrics


def test_install_twice_wraps_once_and_uninstall_restores(stock):
    originals = PPOTrainer.__dict__["_balance_batch"], RayPPOTrainer.__dict__["_balance_batch"]
    verl_trainer.install()
    wrapped = PPOTrainer.__dict__["_balance_batch"], RayPPOTrainer.__dict__["_balance_batch"]
    verl_trainer.install()
    assert (PPOTrainer.__dict__["_balance_batch"],
            RayPPOTrainer.__dict__["_balance_batch"]) == wrapped != originals
    verl_trainer.uninstall()
    assert (PPOTrainer.__dict__["_balance_batch"],
            RayPPOTrainer.__dict__["_balance_batch"]) == originals


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    import verl_workers

    return verl_workers.make_model_dir(str(tmp_path_factory.mktemp("verl")))


def test_external_lib_installs_it_where_the_trainer_reads_its_model_config(model_dir):
    # what v1's _init_tokenizer (and v0's TaskRunner.run) does with actor_rollout_ref.model
    code = f"""
import warnings; warnings.filterwarnings("ignore")
from omegaconf import OmegaConf
from verl.trainer.ppo.v1 import PPOTrainer
from verl.utils.config import omega_conf_to_dataclass
assert PPOTrainer._balance_batch.__module__ == "verl.trainer.ppo.v1.trainer_base"
omega_conf_to_dataclass(OmegaConf.create({{"_target_": "verl.workers.config.HFModelConfig",
                                          "path": {model_dir!r},
                                          "external_lib": "treepack.verl"}}))
assert PPOTrainer._balance_batch.__module__ == "treepack.adapters.verl.trainer", PPOTrainer._balance_batch
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
