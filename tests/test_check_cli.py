"""`vllm-peagle check`: configs and tokenizers only, every incompatibility, non-zero exit."""

import json

from tests.drafter_edits import broken_copy, set_keys
from vllm_peagle.cli import main


def test_compatible_drafter_passes(local_models, capsys):
    assert (
        main(["check", str(local_models.peagle_native), "--target", str(local_models.target)]) == 0
    )
    assert capsys.readouterr().out.startswith("OK ")


def test_every_problem_is_listed(local_models, tmp_path, capsys):
    drafter = broken_copy(
        local_models.peagle_native,
        tmp_path / "d",
        edit_config=set_keys(vocab_size=999, eagle_aux_hidden_state_layer_ids=[1, 2, 40]),
    )
    assert main(["check", str(drafter), "--target", str(local_models.target), "-k", "40"]) == 1
    out = capsys.readouterr().out
    assert "has vocab_size 999" in out and "fuses target layers" in out
    assert all(line.startswith("FAIL ") and "Fix:" in line for line in out.splitlines())


def test_k_out_of_range_fails(local_models, capsys):
    args = ["check", str(local_models.peagle_native), "--target", str(local_models.target)]
    assert main([*args, "-k", "40"]) == 1
    assert "outside 1..32" in capsys.readouterr().out


def test_tokenizer_of_another_target_is_named(local_models, tmp_path, capsys):
    drafter = broken_copy(local_models.peagle_native, tmp_path / "d")
    tokenizer = json.loads((drafter / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (drafter / "tokenizer.json").write_text(json.dumps(tokenizer))
    assert main(["check", str(drafter), "--target", str(local_models.target)]) == 1
    assert "ships a tokenizer that differs" in capsys.readouterr().out
