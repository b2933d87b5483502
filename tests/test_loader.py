"""Checkpoint loading: fp8 block dequantization, shards, errors, tokenizers, tiny model."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedmla.models.loader import iter_checkpoint_tensors, load_model
from pagedmla.models.tiny import tiny_config, write_tiny_checkpoint
from pagedmla.ops.block_fp8 import dequantize_blocks
from pagedmla.tokenizer import ByteTokenizer, load_tokenizer

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


def quantize_by_hand(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-block amax/448 scales and the fp8 weight, one block at a time."""
    rows, cols = w.shape
    grid = (math.ceil(rows / block[0]), math.ceil(cols / block[1]))
    scale = torch.empty(grid)
    q = torch.empty(rows, cols, dtype=FP8)
    for i in range(grid[0]):
        for j in range(grid[1]):
            rs = slice(i * block[0], (i + 1) * block[0])
            cs = slice(j * block[1], (j + 1) * block[1])
            scale[i, j] = w[rs, cs].abs().max() / FP8_MAX
            q[rs, cs] = (w[rs, cs] / scale[i, j]).to(FP8)
    return q, scale


def dequantize_by_hand(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]):
    out = torch.empty(q.shape)
    for r in range(q.shape[0]):
        for c in range(q.shape[1]):
            out[r, c] = q[r, c].float() * scale[r // block[0], c // block[1]]
    return out


@pytest.mark.parametrize("block", [(128, 128), (64, 48)])
def test_dequantize_matches_hand_formula_with_partial_blocks(block):
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(300, 200, generator=gen) * torch.rand(300, 1, generator=gen)
    q, scale = quantize_by_hand(w, block)
    got = dequantize_blocks(q, scale, block)
    assert got.dtype == torch.float32
    assert torch.equal(got, dequantize_by_hand(q, scale, block))
    # e4m3 keeps 3 mantissa bits: rounding error <= 2^-4 relative for normal values,
    # and <= 2^-10 (in units of the block scale) below the smallest normal, 2^-6.
    per_elem_scale = dequantize_by_hand(torch.ones_like(q), scale, block)
    bound = torch.maximum(w.abs() * 2**-4, per_elem_scale * 2**-10) * 1.0001
    assert ((got - w).abs() <= bound).all()
    assert dequantize_blocks(q, scale, block, torch.bfloat16).dtype == torch.bfloat16


def test_dequantize_rejects_wrong_scale_shape():
    q = torch.zeros(130, 128, dtype=FP8)
    with pytest.raises(ValueError, match=r"\(2, 1\)"):
        dequantize_blocks(q, torch.ones(1, 1))


def _save_sharded(directory: Path, shards: dict[str, dict[str, torch.Tensor]], index: bool):
    directory.mkdir(parents=True, exist_ok=True)
    for file, tensors in shards.items():
        save_file(tensors, str(directory / file))
    if index:
        weight_map = {n: f for f, tensors in shards.items() for n in tensors}
        (directory / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": weight_map})
        )


@pytest.mark.parametrize("index", [True, False])
def test_scale_found_in_another_shard(tmp_path, index):
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(130, 260, generator=gen)
    q, scale = quantize_by_hand(w, (128, 128))
    plain = torch.randn(5, 3, generator=gen).to(torch.bfloat16)
    shards = {
        "a.safetensors": {"x.weight": q, "plain.weight": plain},
        "b.safetensors": {"x.weight_scale_inv": scale},
    }
    _save_sharded(tmp_path, shards, index)
    (tmp_path / "config.json").write_text(json.dumps({}))
    got = dict(iter_checkpoint_tensors(tmp_path, dtype=torch.float64))
    assert set(got) == {"x.weight", "plain.weight"}
    expected = dequantize_by_hand(q, scale, (128, 128)).double()
    assert got["x.weight"].dtype == torch.float64 and torch.equal(got["x.weight"], expected)
    assert got["plain.weight"].dtype == torch.bfloat16 and torch.equal(got["plain.weight"], plain)


def test_block_size_from_quantization_config(tmp_path):
    w = torch.randn(100, 70)
    q, scale = quantize_by_hand(w, (32, 64))
    save_file({"x.weight": q, "x.weight_scale_inv": scale}, str(tmp_path / "model.safetensors"))
    quant = {"quant_method": "fp8", "weight_block_size": [32, 64]}
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": quant}))
    (_, got), *_ = iter_checkpoint_tensors(tmp_path)
    assert torch.equal(got, dequantize_by_hand(q, scale, (32, 64)))


@pytest.mark.parametrize(
    ("tensors", "message"),
    [
        ({"x.weight": torch.zeros(4, 4, dtype=FP8)}, "no x.weight_scale_inv"),
        ({"x.weight": torch.zeros(4, 4), "x.weight_scale_inv": torch.ones(1, 1)}, "dtype"),
        ({"y.weight_scale_inv": torch.ones(1, 1)}, "has no weight"),
    ],
)
def test_inconsistent_fp8_tensors_are_refused(tmp_path, tensors, message):
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=message):
        dict(iter_checkpoint_tensors(tmp_path))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


def _state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_tiny_checkpoint_loads_the_builtin_model(tiny_dir, tmp_path, monkeypatch):
    # "tiny" without the trained weights the package may ship: the random tiny model.
    monkeypatch.setattr("pagedmla.models.tiny.TRAINED_DIR", tmp_path / "absent")
    builtin, builtin_config, _ = load_model("tiny")
    loaded, config, tokenizer = load_model(tiny_dir)
    assert config == builtin_config
    a, b = _state(builtin), _state(loaded)
    assert a.keys() == b.keys() and a
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert tokenizer is not None
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (1, 2)


def test_fp8_checkpoint_keeps_its_weights_in_fp8(tmp_path, tiny_dir):
    fp8_dir = write_tiny_checkpoint(tmp_path / "fp8", fp8=True)
    quant = json.loads((fp8_dir / "config.json").read_text())["quantization_config"]
    assert quant["weight_block_size"] == [128, 128]
    stored = {**load_file(fp8_dir / "model-00001-of-00002.safetensors"),
              **load_file(fp8_dir / "model-00002-of-00002.safetensors")}
    reference, *_ = load_model(tiny_dir)
    quantized, *_ = load_model(fp8_dir, dtype=torch.float32)
    a, b = _state(reference), _state(quantized)
    kept = {k for k, v in b.items() if v.dtype == FP8}
    # Every linear layer of attention, the MLPs and the experts, but kv_b_proj.
    linears = {k for k in a if re.search(r"_proj(_with_mqa)?\.weight$|mlp\.w(13|2)$", k)}
    assert kept == {k for k in linears if "kv_b_proj" not in k}
    for name in sorted(kept):
        scale = b.pop(name + "_scale_inv")
        b.pop(name)
        if name.endswith(("w13", "w2")):
            continue  # stacked experts: compared per expert below
        ours = dequantize_blocks(quantized.state_dict()[name], scale, (128, 128))
        assert torch.equal(ours, dequantize_blocks(stored["model." + name],
                                                   stored[f"model.{name}_scale_inv"]))
        err = (ours - a.pop(name)).abs().max().item()
        assert err <= 2**-4 * ours.abs().max().item() + 1e-6, name
    w13 = quantized.layers[1].mlp.w13
    scales = quantized.layers[1].mlp.w13_scale_inv
    up = "model.layers.1.mlp.experts.3.up_proj.weight"
    assert torch.equal(w13[3, w13.shape[1] // 2:].view(torch.uint8), stored[up].view(torch.uint8))
    assert torch.equal(scales[3, 1], stored[up + "_scale_inv"])
    # kv_b_proj is dequantized as it is loaded; the other tensors are as stored.
    for name in b:
        if "kv_b_proj" in name:
            assert (b[name] - a[name]).abs().max() <= 2**-4 * a[name].abs().max() + 1e-6
        else:
            assert torch.equal(b[name], a[name]), name


def _rewrite_shard(directory: Path, edit) -> None:
    """Apply `edit` to the tensors of the first shard and keep the index consistent."""
    file = directory / "model-00001-of-00002.safetensors"
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, str(file))
    index_path = directory / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"] = {
        n: f for n, f in index["weight_map"].items() if f != file.name or n in tensors
    }
    index["weight_map"].update(dict.fromkeys(tensors, file.name))
    index_path.write_text(json.dumps(index))


def test_missing_tensor_is_named(tmp_path):
    directory = write_tiny_checkpoint(tmp_path)
    _rewrite_shard(directory, lambda t: t.pop("model.embed_tokens.weight"))
    with pytest.raises(ValueError, match=r"lacks 1 tensor.*model\.embed_tokens\.weight"):
        load_model(directory)


def test_shape_mismatch_is_refused(tmp_path):
    directory = write_tiny_checkpoint(tmp_path)
    name = "model.embed_tokens.weight"
    _rewrite_shard(directory, lambda t: t.update({name: t[name][:-1].clone()}))
    with pytest.raises(ValueError, match="embed_tokens"):
        load_model(directory)


def test_multi_token_prediction_layers_are_skipped(tmp_path):
    directory = write_tiny_checkpoint(tmp_path)
    mtp = f"model.layers.{tiny_config()['num_hidden_layers']}.eh_proj.weight"
    _rewrite_shard(directory, lambda t: t.update({mtp: torch.zeros(3, 3)}))
    load_model(directory)


def test_unsupported_architecture(tmp_path):
    directory = write_tiny_checkpoint(tmp_path)
    config = {**tiny_config(), "model_type": "llama", "architectures": ["LlamaForCausalLM"]}
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="llama"):
        load_model(directory)


def test_unsupported_quantization(tmp_path):
    directory = write_tiny_checkpoint(tmp_path)
    config = {**tiny_config(), "quantization_config": {"quant_method": "awq"}}
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="awq"):
        load_model(directory)


def test_missing_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="tiny"):
        load_model(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        load_model(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(tiny_config()))
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_model(tmp_path)


TEXTS = ["", "hello world", "héllo wörld, 世界 🙂\n\ttabs", "a" * 300]


@pytest.mark.parametrize("text", TEXTS)
def test_byte_tokenizer_round_trip(text):
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id
    assert len(ids) == 1 + len(text.encode("utf-8"))
    assert all(3 <= i < tok.vocab_size for i in ids[1:])
    assert tok.decode([*ids, tok.eos_token_id, tok.pad_token_id]) == text
    assert tok.encode(text, add_special_tokens=False) == ids[1:]


def test_byte_tokenizer_decodes_broken_utf8():
    tok = ByteTokenizer()
    ids = tok.encode("é", add_special_tokens=False)
    assert tok.decode(ids[:1]) == "\ufffd"
    assert tok.decode([*ids[:1], *tok.encode("x", add_special_tokens=False)]) == "\ufffdx"


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_json_agrees_with_byte_tokenizer(tiny_dir, text):
    file_tok = load_tokenizer(tiny_dir, tiny_config())
    byte_tok = ByteTokenizer()
    assert file_tok.encode(text) == byte_tok.encode(text)
    assert file_tok.decode([*byte_tok.encode(text), 2]) == text


def test_tokenizer_special_ids_from_tokenizer_config(tmp_path, tiny_dir):
    (tmp_path / "tokenizer.json").write_bytes((tiny_dir / "tokenizer.json").read_bytes())
    assert load_tokenizer(tmp_path / "elsewhere", {}) is None
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": {"content": "<bos>"}, "eos_token": "<eos>"})
    )
    tok = load_tokenizer(tmp_path, {})
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 2)
    assert load_tokenizer(tmp_path, {"eos_token_id": [0, 2]}).eos_token_id == 0


# Checkpoint faults: each error names the file (and the key or tensor).

SHARD_1 = "model-00001-of-00002.safetensors"
SHARD_2 = "model-00002-of-00002.safetensors"


def _edit_shard(path: Path, edit) -> None:
    """Apply `edit` to the tensors of the shard file `path` in place (same names)."""
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, str(path))


@pytest.mark.parametrize("keep", [8, 100, -1])
@pytest.mark.parametrize("index", [True, False])
def test_truncated_shard_is_named(tmp_path, keep, index):
    directory = write_tiny_checkpoint(tmp_path)
    if not index:
        (directory / "model.safetensors.index.json").unlink()
    shard = directory / SHARD_2
    data = shard.read_bytes()
    shard.write_bytes(data[:keep])  # keep the first bytes: header length, part of the header
    match = rf"{re.escape(str(shard))} is not a complete safetensors file"
    with pytest.raises(ValueError, match=match):
        iter_checkpoint_tensors(directory)  # found from the headers, before any tensor is read
    with pytest.raises(ValueError, match=match):
        load_model(directory)


def test_index_listing_a_tensor_its_shard_lacks(tmp_path):
    directory = write_tiny_checkpoint(tmp_path)
    tensors = load_file(directory / SHARD_1)
    del tensors["model.embed_tokens.weight"]
    save_file(tensors, str(directory / SHARD_1))
    with pytest.raises(ValueError, match=rf"{SHARD_1} lacks 1 tensor.*model\.embed_tokens\.weight"):
        load_model(directory)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"vocab_size": 259,', "is not valid JSON"),
        ("[1, 2]", "must hold a JSON object, got list"),
        (b"\xff\xfe{}", "is not valid JSON"),
    ],
)
@pytest.mark.parametrize("file", ["config.json", "model.safetensors.index.json"])
def test_broken_json_is_named(tmp_path, file, text, message):
    directory = write_tiny_checkpoint(tmp_path)
    path = directory / file
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(ValueError, match=rf"{re.escape(str(path))} {message}"):
        load_model(directory)


@pytest.mark.parametrize(
    ("file", "text", "message"),
    [
        ("tokenizer_config.json", '{"eos_token": ', "is not valid JSON"),
        ("tokenizer_config.json", '"<eos>"', "must hold a JSON object, got str"),
        ("tokenizer.json", '{"model": 3}', "is not a tokenizers tokenizer"),
    ],
)
def test_broken_tokenizer_files_are_named(tmp_path, file, text, message):
    directory = write_tiny_checkpoint(tmp_path)
    path = directory / file
    path.write_text(text)
    with pytest.raises(ValueError, match=rf"{re.escape(str(path))} {message}"):
        load_model(directory)


def _without(key: str) -> dict:
    config = tiny_config()
    del config[key]
    return config


@pytest.mark.parametrize(
    ("config", "key"),
    [
        (_without("hidden_size"), "missing required key 'hidden_size'"),
        (_without("kv_lora_rank"), "missing required key 'kv_lora_rank'"),
        ({**tiny_config(), "vocab_size": None}, "missing required key 'vocab_size'"),
        ({**tiny_config(), "hidden_size": "128"}, "'hidden_size' must be an integer"),
        ({**tiny_config(), "num_attention_heads": 4.5}, "'num_attention_heads' must be an int"),
        ({**tiny_config(), "num_hidden_layers": 0}, "'num_hidden_layers' must be an integer >= 1"),
        ({**tiny_config(), "q_lora_rank": True}, "'q_lora_rank' must be an integer"),
        ({**tiny_config(), "n_group": "2"}, "'n_group' must be an integer"),
        ({**tiny_config(), "rms_norm_eps": -1.0}, "'rms_norm_eps' must be a finite positive"),
        ({**tiny_config(), "rope_theta": "1e4"}, "'rope_theta' must be a finite positive"),
        ({**tiny_config(), "norm_topk_prob": "yes"}, "'norm_topk_prob' must be true or false"),
        ({**tiny_config(), "eos_token_id": "2"}, "'eos_token_id' must be an integer"),
        ({**tiny_config(), "eos_token_id": [2, "x"]}, "'eos_token_id' must be an integer"),
        ({**tiny_config(), "architectures": "DeepseekV3ForCausalLM"}, "'architectures' must be"),
        ({**tiny_config(), "rope_scaling": [4.0]}, "'rope_scaling' must be an object"),
        (
            {**tiny_config(), "rope_scaling": {**tiny_config()["rope_scaling"], "factor": "4"}},
            "'rope_scaling.factor' must be a finite number",
        ),
        (
            {**tiny_config(), "quantization_config": {"quant_method": "fp8",
                                                      "weight_block_size": [128]}},
            "'quantization_config.weight_block_size' must be two positive integers",
        ),
    ],
)
def test_bad_config_key_is_named(tmp_path, config, key):
    directory = write_tiny_checkpoint(tmp_path)
    path = directory / "config.json"
    path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match=rf"{re.escape(str(path))}: .*{re.escape(key)}"):
        load_model(directory)


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_weight_is_refused_with_its_name_and_file(tmp_path, value):
    directory = write_tiny_checkpoint(tmp_path)
    name = "model.layers.1.mlp.experts.3.down_proj.weight"
    file = json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"][name]

    def poison(tensors):
        tensors[name][5, 7] = value

    _edit_shard(directory / file, poison)
    with pytest.raises(ValueError, match=rf"{re.escape(file)}: weight '{re.escape(name)}' has "
                                         "NaN or inf"):
        load_model(directory)


def test_weight_that_overflows_the_model_dtype_is_refused(tmp_path):
    directory = write_tiny_checkpoint(tmp_path)
    name = "model.norm.weight"
    _edit_shard(directory / SHARD_2, lambda t: t[name].fill_(1e5))  # > float16's 65504
    load_model(directory)
    with pytest.raises(ValueError, match=rf"'{re.escape(name)}' has NaN or inf .*float16"):
        load_model(directory, dtype=torch.float16)


NAN_E4M3 = 0x7F  # s.1111.111: float8_e4m3fn has NaN codes and no infinity


@pytest.mark.parametrize("where", ["code", "scale"])
def test_non_finite_fp8_weight_is_refused(tmp_path, where):
    directory = write_tiny_checkpoint(tmp_path, fp8=True)
    name = "model.layers.0.self_attn.kv_b_proj.weight"
    weight_map = json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"]
    scale_name = name + "_scale_inv"

    def poison(tensors):
        if where == "code":
            tensors[name].view(torch.uint8)[3, 4] = NAN_E4M3
        else:
            tensors[scale_name][0, 0] = math.inf

    _edit_shard(directory / weight_map[name if where == "code" else scale_name], poison)
    # The weight is named, with the file that holds it (its scale may be in the other shard).
    with pytest.raises(ValueError, match=rf"{re.escape(weight_map[name])}: weight "
                                         rf"'{re.escape(name)}' has NaN or inf"):
        load_model(directory)
