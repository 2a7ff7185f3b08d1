"""Trainer: vLLM aux-state semantics, learning, exact resume, export, both drafter kinds."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch

from vllm_peagle.checkpoint import load_drafter, read_drafter_config
from vllm_peagle.config import TargetSpec, check_drafter_for_target, read_drafter
from vllm_peagle.training.cod import CodConfig
from vllm_peagle.training.data import stdlib_prompts
from vllm_peagle.training.hidden_states import TargetModel, check_aux_layer_ids
from vllm_peagle.training.step import drafter_loss, make_batch
from vllm_peagle.training.trainer import TrainConfig, Trainer, lr_lambda


@pytest.fixture(scope="module")
def tiny_data(local_models, tmp_path_factory) -> Path:
    """Held-in stdlib windows (prompt_len 0) plus looping repeats, as JSON lines."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(local_models.target))
    path = tmp_path_factory.mktemp("data") / "data.jsonl"
    lines = []
    for i, text in enumerate(stdlib_prompts("held_in", 24, seed=7, min_chars=250)):
        ids = tok(text)["input_ids"][:72]
        if i % 2:  # greedy decoding of the tiny target loops; imitate that cheaply
            ids = (ids[:24] * 3)[:72]
        lines.append(json.dumps({"input_ids": ids, "prompt_len": 4}))
    path.write_text("\n".join(lines) + "\n")
    return path


def _config(local_models, data: Path, out: Path, **kw) -> TrainConfig:
    base = dict(
        target=str(local_models.target),
        data=str(data),
        out=str(out),
        num_depths=3,
        steps=6,
        batch_size=2,
        max_seq_len=72,
        lr=3e-3,
        warmup_steps=2,
        checkpoint_every=3,
        log_every=1,
        num_threads=1,
        export=False,
    )
    base.update(kw)
    return TrainConfig(**base)


def test_aux_states_are_inputs_of_decoder_layers(local_models) -> None:
    # vLLM: aux id i = hidden + residual entering decoder layer i (0 = embeddings).
    target = TargetModel(local_models.target, [0, 1, 3])
    seen: dict[int, torch.Tensor] = {}
    hooks = [
        layer.register_forward_pre_hook(
            lambda mod, args, kwargs, i=i: seen.__setitem__(
                i, (args[0] if args else kwargs["hidden_states"]).detach()
            ),
            with_kwargs=True,
        )
        for i, layer in enumerate(target.model.model.layers)
    ]
    ids = torch.tensor([[1, 50, 60, 70, 80, 90, 100]])
    aux, _ = target.hidden(ids)
    for h in hooks:
        h.remove()
    h = target.hidden_size
    for slot, layer_id in enumerate([0, 1, 3]):
        torch.testing.assert_close(aux[..., slot * h : (slot + 1) * h], seen[layer_id])
    logits = target.features(ids).logits
    ref = target.model(input_ids=ids).logits
    torch.testing.assert_close(logits, ref)


def test_aux_layer_ids_checked() -> None:
    assert check_aux_layer_ids([1, 2, 3], 4) == [1, 2, 3]
    with pytest.raises(ValueError, match="repeat"):
        check_aux_layer_ids([2, 2, 1], 4)  # vLLM's default (2, n//2, n-3) for n = 4
    with pytest.raises(ValueError, match="outside"):
        check_aux_layer_ids([1, 2, 4], 4)


def test_lr_schedule_warmup_then_cosine() -> None:
    values = [lr_lambda(s, 4, 20, 0.1) for s in range(21)]
    assert values[:4] == [0.25, 0.5, 0.75, 1.0]
    assert all(a >= b for a, b in itertools.pairwise(values[3:]))
    assert values[-1] == pytest.approx(0.1)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["peagle", "eagle3"])
def test_loss_decreases_and_depth_accuracy_rises(local_models, tiny_data, tmp_path, kind) -> None:
    cfg = _config(local_models, tiny_data, tmp_path, kind=kind, steps=30, batch_size=4)
    trainer = Trainer(cfg)
    held = make_batch(
        trainer.samples[:6],
        trainer.target,
        CodConfig(3, 1.0, 1.0),  # every rollout, so each depth is measured
        torch.Generator().manual_seed(0),
        trainer.pad_id,
    )

    def measure() -> tuple[float, list[float]]:
        with torch.no_grad():
            loss, stats = drafter_loss(trainer.drafter, held, kind)
        return float(loss), stats["acc"]

    loss0, acc0 = measure()
    trainer.run(progress=False)
    loss1, acc1 = measure()
    assert loss1 < 0.8 * loss0, (loss0, loss1)
    assert all(b > a for a, b in zip(acc0, acc1, strict=True)), (acc0, acc1)
    assert trainer.history[-1]["step"] == 30


def test_resume_is_bit_identical(local_models, tiny_data, tmp_path) -> None:
    straight = Trainer(_config(local_models, tiny_data, tmp_path / "a"))
    straight.run(progress=False)

    first = Trainer(_config(local_models, tiny_data, tmp_path / "b"))
    first.run(stop_at=3, progress=False)  # "interrupted" right after the step-3 checkpoint
    del first
    resumed = Trainer(_config(local_models, tiny_data, tmp_path / "b"))
    assert resumed.load_checkpoint() and resumed.step == 3
    resumed.run(progress=False)

    assert [r["loss"] for r in resumed.history] == [r["loss"] for r in straight.history]
    for (name, a), (_, b) in zip(
        straight.drafter.state_dict().items(), resumed.drafter.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name
    opt_a, opt_b = straight.opt.state_dict()["state"], resumed.opt.state_dict()["state"]
    assert all(torch.equal(opt_a[k]["exp_avg"], opt_b[k]["exp_avg"]) for k in opt_a)


def test_resume_refuses_changed_settings(local_models, tiny_data, tmp_path) -> None:
    Trainer(_config(local_models, tiny_data, tmp_path)).run(stop_at=3, progress=False)
    other = Trainer(_config(local_models, tiny_data, tmp_path, lr=1e-4))
    with pytest.raises(ValueError, match="lr"):
        other.load_checkpoint()


def test_export_both_layouts_records_k(local_models, tiny_data, tmp_path) -> None:
    cfg = _config(local_models, tiny_data, tmp_path, steps=2, num_depths=5, export=True)
    result = Trainer(cfg).run(progress=False)
    native, spec = Path(result.exported["native"]), Path(result.exported["speculators"])
    assert read_drafter_config(native)[1] == "native"
    assert read_drafter_config(spec)[1] == "speculators"
    assert read_drafter(str(spec)).trained_num_speculative_tokens == 5
    target = TargetSpec.from_dict(
        json.loads((local_models.target / "config.json").read_text()), "tiny"
    )
    assert check_drafter_for_target(read_drafter(str(native)), target) == []
    trained = result.drafter.state_dict()
    for path in (native, spec):
        loaded = load_drafter(path).state_dict()
        assert all(torch.equal(loaded[k], trained[k]) for k in trained)
    summary = json.loads((tmp_path / "train_summary.json").read_text())
    assert summary["steps"] == 2 and len(summary["history"]) == 2


def test_drafter_starts_from_target_and_trains_embeddings(local_models, tiny_data, tmp_path):
    trainer = Trainer(_config(local_models, tiny_data, tmp_path))
    d = trainer.drafter
    assert torch.equal(d.embed_tokens.weight, trainer.target.embed_weight())
    assert torch.equal(d.lm_head.weight, trainer.target.lm_head_weight())
    assert d.embed_tokens.weight.requires_grad and d.mask_hidden is not None
    mask_id = d.config.mask_token_id
    before = d.embed_tokens.weight[mask_id].clone()
    trainer.run(stop_at=1, progress=False)
    assert not torch.equal(before, d.embed_tokens.weight[mask_id]), "mask row learns"


def test_norm_options_train_and_export(local_models, tiny_data, tmp_path) -> None:
    options = {"norm_before_fc": True, "fc_norm": True, "norm_output": True}
    cfg = _config(local_models, tiny_data, tmp_path, steps=2, export=True, **options)
    result = Trainer(cfg).run(progress=False)
    for path in result.exported.values():
        loaded = load_drafter(Path(path))
        assert all(getattr(loaded.config, key) for key in options), path
        trained = result.drafter.state_dict()
        assert any(k.startswith("fc_norm.") for k in trained)
        assert all(torch.equal(loaded.state_dict()[k], trained[k]) for k in trained)


def test_eagle3_kind_and_bf16(local_models, tiny_data, tmp_path) -> None:
    cfg = _config(local_models, tiny_data, tmp_path, kind="eagle3", dtype="bfloat16", steps=2)
    trainer = Trainer(cfg)
    assert trainer.drafter.mask_hidden is None and not trainer.drafter.config.is_parallel
    trainer.run(progress=False)
    assert all(r["loss"] == r["loss"] for r in trainer.history)  # finite, not NaN


def test_cli_train_then_eval(local_models, tiny_data, tmp_path, capsys) -> None:
    from vllm_peagle.cli import main

    out = tmp_path / "run"
    args = ["train", "--target", str(local_models.target), "--data", str(tiny_data)]
    args += ["--out", str(out), "--steps", "2", "-k", "3", "--max-seq-len", "48"]
    assert main([*args, "--threads", "1", "--batch-size", "2"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["steps"] == 2
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "def main("}) + "\n")
    report = tmp_path / "eval.json"
    args = ["eval", "--target", str(local_models.target), "--drafter", str(out / "drafter")]
    args += ["-k", "3", "--prompts", str(prompts), "--max-tokens", "8", "--json", str(report)]
    assert main([*args, "--threads", "1"]) == 0
    result = json.loads(report.read_text())
    assert (
        result["k"] == 3
        and result["num_drafts"] >= 3
        and len(result["per_position_acceptance"]) == 3
    )
