"""Checkpoint conversion: HF -> megatron_psrl (torch_dist, or legacy TP x PP shards) -> HF is
bit-exact; legacy -> torch_dist keeps every tensor; the legacy shards have megatron's layouts;
the CLI's refusals and atomicity; loading across TP layouts."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch
from helpers.families import family_config
from helpers.hf_reference import load_hf_model
from helpers.launch_pool import run_python
from safetensors import safe_open

from megatron_psrl.checkpoint import ModelSource, OutputExistsError, hf_io, legacy_format, load_model
from megatron_psrl.checkpoint import convert as convert_lib
from megatron_psrl.checkpoint.convert import hf_to_mcore, mcore_to_hf
from megatron_psrl.checkpoint.loading import load_full_state_dict
from megatron_psrl.model.architecture import UnsupportedModelError

REPO = Path(__file__).resolve().parents[2]
TOOL = REPO / "tools" / "convert_hf_checkpoint.py"
ROUND_TRIP_FAMILIES = ("llama-llama3", "qwen2-yarn", "qwen3-tied", "mistral", "deepseek-v3")


def _load_tool():
    spec = importlib.util.spec_from_file_location("psrl_tool_convert_hf_checkpoint", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


cli = _load_tool()


def read_hf_tensors(hf_dir):
    """Every tensor of a safetensors folder (sharded or not), read with safetensors directly."""
    out = {}
    for f in sorted(os.listdir(hf_dir)):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(hf_dir, f), framework="pt") as h:
                for k in h.keys():
                    assert k not in out, f"{k} stored twice"
                    out[k] = h.get_tensor(k)
    return out


def _leftovers(parent, name):
    return [e for e in os.listdir(parent) if e.startswith(f".{name}.")]


@pytest.mark.parametrize("fmt,tp,pp", [("legacy", 1, 1), ("legacy", 2, 1), ("legacy", 2, 2), ("torch_dist", 1, 1)],
                         ids=["tp1", "tp2", "tp2pp2", "torch_dist"])
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("family", ROUND_TRIP_FAMILIES)
def test_round_trip_is_bit_exact(family, dtype, fmt, tp, pp, sharded_hf, tmp_path):
    src = sharded_hf(family, dtype)
    assert len([f for f in os.listdir(src) if f.endswith(".safetensors")]) > 1  # sharded input
    ckpt, back = tmp_path / "ckpt", tmp_path / "back"
    info = hf_to_mcore(src, str(ckpt), tp=tp, pp=pp, progress=False, ckpt_format=fmt)
    assert (info.tensor_parallel_size, info.pipeline_parallel_size) == (tp, pp)
    assert info.dtype == {"bf16": "bfloat16", "fp32": "float32"}[dtype]
    files = sorted(os.listdir(ckpt / "release"))
    if fmt == "legacy":
        expected = [f"mp_rank_{r:02d}" if pp == 1 else f"mp_rank_{r:02d}_{p:03d}" for r in range(tp) for p in range(pp)]
    else:  # megatron's dist_checkpointing files, written by one process
        expected = [".metadata", "__0_0.distcp", "common.pt", "metadata.json"]
    assert files == sorted(expected + ["checksums.sha256", "psrl_model.json"])
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "release"

    mcore_to_hf(str(ckpt), str(back), hf_template=src, progress=False)
    a, b = read_hf_tensors(src), read_hf_tensors(str(back))
    assert set(a) == set(b)
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        assert a[name].shape == b[name].shape, name
        assert torch.equal(a[name], b[name]), name
    assert json.loads((back / "config.json").read_text()) == json.loads(Path(src, "config.json").read_text())
    assert (back / "generation_config.json").exists()  # copied from the template


def test_tp_shards_have_megatron_layouts(sharded_hf, tmp_path):
    """Rank r of TP=2 holds key/value group r's q heads, k head and v head (and biases) in
    linear_qkv, its halves of gate and up in linear_fc1, its input columns of linear_proj /
    linear_fc2, and its vocab rows (padded 301 -> 302 with a zero row) - built here from the
    HF tensors directly."""
    src = sharded_hf("qwen2-yarn", "fp32")
    cfg = family_config("qwen2-yarn")
    hf = read_hf_tensors(src)
    hf_to_mcore(src, str(tmp_path / "ck"), tp=2, pp=1, progress=False, ckpt_format="legacy")
    np_, ng, hd, ffn = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"], cfg["intermediate_size"]
    rep = np_ // ng
    for r in range(2):
        shard = torch.load(tmp_path / "ck" / "release" / f"mp_rank_{r:02d}" / "model_optim_rng.pt")["model"]
        for kind in ("weight", "bias"):
            q = hf[f"model.layers.1.self_attn.q_proj.{kind}"]
            k = hf[f"model.layers.1.self_attn.k_proj.{kind}"]
            v = hf[f"model.layers.1.self_attn.v_proj.{kind}"]
            g = r  # one group per rank (ng = 2, TP = 2)
            expected = torch.cat([q[g * rep * hd:(g + 1) * rep * hd], k[g * hd:(g + 1) * hd], v[g * hd:(g + 1) * hd]])
            assert torch.equal(shard[f"decoder.layers.1.self_attention.linear_qkv.{kind}"], expected)
        half = ffn // 2
        gate, up = hf["model.layers.0.mlp.gate_proj.weight"], hf["model.layers.0.mlp.up_proj.weight"]
        assert torch.equal(shard["decoder.layers.0.mlp.linear_fc1.weight"],
                           torch.cat([gate[r * half:(r + 1) * half], up[r * half:(r + 1) * half]]))
        down = hf["model.layers.0.mlp.down_proj.weight"]
        assert torch.equal(shard["decoder.layers.0.mlp.linear_fc2.weight"], down[:, r * half:(r + 1) * half])
        o = hf["model.layers.0.self_attn.o_proj.weight"]
        width = np_ * hd // 2
        assert torch.equal(shard["decoder.layers.0.self_attention.linear_proj.weight"], o[:, r * width:(r + 1) * width])
        emb = shard["embedding.word_embeddings.weight"]
        assert emb.shape == (151, cfg["hidden_size"])
        full = torch.cat([hf["model.embed_tokens.weight"], torch.zeros(1, cfg["hidden_size"])])
        assert torch.equal(emb, full[r * 151:(r + 1) * 151])
        assert torch.equal(shard["decoder.final_layernorm.weight"], hf["model.norm.weight"])
        assert "output_layer.weight" not in shard  # tied, PP = 1


def test_pipeline_stages_hold_their_layers_and_a_tied_output_copy(sharded_hf, tmp_path):
    src = sharded_hf("qwen3-tied", "fp32")
    hf = read_hf_tensors(src)
    hf_to_mcore(src, str(tmp_path / "ck"), tp=1, pp=2, progress=False, ckpt_format="legacy")
    first = torch.load(tmp_path / "ck" / "release" / "mp_rank_00_000" / "model_optim_rng.pt")["model"]
    last = torch.load(tmp_path / "ck" / "release" / "mp_rank_00_001" / "model_optim_rng.pt")["model"]
    assert torch.equal(first["decoder.layers.0.self_attention.q_layernorm.weight"], hf["model.layers.0.self_attn.q_norm.weight"])
    assert torch.equal(last["decoder.layers.0.self_attention.k_layernorm.weight"], hf["model.layers.1.self_attn.k_norm.weight"])
    assert "embedding.word_embeddings.weight" in first and "decoder.final_layernorm.weight" not in first
    assert torch.equal(last["output_layer.weight"], hf["model.embed_tokens.weight"])  # megatron's tied copy
    assert not any(k.startswith("decoder.layers.1.") for k in list(first) + list(last))


def test_tp2_checkpoint_loads_into_tp1_model_with_hf_logprobs(sharded_hf, tmp_path):
    from megatron_psrl.attention import TreeAttentionMetadata, causal_plan
    from megatron_psrl.distributed.setup import initialize_parallel
    from megatron_psrl.model import vocab_parallel_logprobs

    initialize_parallel(1, 1, device="cpu")
    src = sharded_hf("qwen2-yarn", "fp32")
    hf_to_mcore(src, str(tmp_path / "ck"), tp=2, pp=2, progress=False, ckpt_format="legacy")
    arch, model, optimizer_state = load_model(ModelSource(checkpoint=str(tmp_path / "ck")))
    assert optimizer_state is None  # layout differs: no optimizer state to restore
    hf = load_hf_model(src)
    tokens = torch.randint(0, arch.vocab_size, (30,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hidden = model(tokens, torch.arange(30), TreeAttentionMetadata(plan=causal_plan([30])))[:, 0]
        lp, _ = vocab_parallel_logprobs(model.output_logits(hidden[:-1]), tokens[1:], arch.vocab_size)
        ref = torch.log_softmax(hf(tokens[None]).logits[0, :-1].float(), -1).gather(1, tokens[1:, None])[:, 0]
    assert (lp - ref).abs().max().item() <= 1e-4


# ------------------------------------------------------------------------------------ CLI
def test_cli_round_trip_and_force(sharded_hf, tmp_path, capsys):
    src = sharded_hf("mistral", "bf16")
    out = tmp_path / "ckpt"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    rc = cli.main(["hf-to-mcore", "--hf-dir", src, "--out-dir", str(out), "--tp", "2", "--no-progress",
                   "--ckpt-format", "legacy"])
    err = capsys.readouterr().err
    assert rc == 2 and "--force" in err
    assert (out / "precious.txt").read_text() == "keep me" and sorted(os.listdir(out)) == ["precious.txt"]

    rc = cli.main(["hf-to-mcore", "--hf-dir", src, "--out-dir", str(out), "--tp", "2", "--force", "--no-progress",
                   "--ckpt-format", "legacy"])
    assert rc == 0 and "TP=2" in capsys.readouterr().out
    assert not (out / "precious.txt").exists() and (out / "release" / "mp_rank_01").is_dir()
    assert _leftovers(tmp_path, "ckpt") == []

    back = tmp_path / "hf"
    assert cli.main(["mcore-to-hf", "--load", str(out), "--out-dir", str(back), "--no-progress"]) == 0
    a, b = read_hf_tensors(src), read_hf_tensors(str(back))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)
    # again into the now non-empty folder: refused, then forced
    assert cli.main(["mcore-to-hf", "--load", str(out), "--out-dir", str(back), "--no-progress"]) == 2
    assert "--force" in capsys.readouterr().err
    assert cli.main(["mcore-to-hf", "--load", str(out), "--out-dir", str(back), "--force", "--no-progress"]) == 0


def _write_config(tmp_path, name, cfg):
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    return d


@pytest.mark.parametrize(
    "override,words",
    [
        (dict(model_type="deepseek_v2", n_routed_experts=8, moe_intermediate_size=32),
         ["mixture-of-experts", "deepseek_v2"]),
        (dict(model_type="gpt2"), ["gpt2"]),
        (dict(hidden_act="gelu"), ["activation", "gelu"]),
        (dict(rope_scaling=dict(rope_type="dynamic", factor=2.0)), ["RoPE", "dynamic"]),
    ],
    ids=["deepseek_v2", "gpt2", "gelu", "dynamic-rope"],
)
def test_cli_refuses_unsupported_models_without_output(override, words, tmp_path, capsys):
    src = _write_config(tmp_path, "src", dict(family_config("mistral"), **override))
    out = tmp_path / "out"
    rc = cli.main(["hf-to-mcore", "--hf-dir", str(src), "--out-dir", str(out), "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2
    for w in words:
        assert w in err
    assert not out.exists() and _leftovers(tmp_path, "out") == []


@pytest.mark.slow  # a subprocess
def test_cli_process_exit_code_for_unsupported_model(tmp_path):
    """The real command line (a separate process): exit status 2, message on stderr, no output."""
    src = _write_config(tmp_path, "src", dict(family_config("mistral"), model_type="deepseek_v2", n_routed_experts=8))
    out = tmp_path / "out"
    proc = run_python(str(TOOL), ["hf-to-mcore", "--hf-dir", str(src), "--out-dir", str(out)], cwd=tmp_path,
                      timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "deepseek_v2" in proc.stderr and "mixture-of-experts" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not out.exists() and _leftovers(tmp_path, "out") == []


def test_cli_missing_input_is_a_clear_error(tmp_path, capsys):
    rc = cli.main(["hf-to-mcore", "--hf-dir", str(tmp_path / "nope"), "--out-dir", str(tmp_path / "o"), "--no-progress"])
    assert rc == 2 and "config.json" in capsys.readouterr().err
    rc = cli.main(["mcore-to-hf", "--load", str(tmp_path), "--out-dir", str(tmp_path / "o"), "--no-progress"])
    assert rc == 2 and "not a megatron_psrl checkpoint" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_missing_tensor_is_refused(sharded_hf, tmp_path):
    src = Path(sharded_hf("llama-llama3", "fp32"))
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in os.listdir(src):
        os.symlink(src / f, broken / f)
    index = json.loads((src / "model.safetensors.index.json").read_text())
    del index["weight_map"]["model.layers.1.mlp.up_proj.weight"]
    (broken / "model.safetensors.index.json").unlink()
    (broken / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="model.layers.1.mlp.up_proj.weight"):
        hf_to_mcore(str(broken), str(tmp_path / "out"), progress=False)
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------ atomicity
class Interrupt(Exception):
    pass


@pytest.mark.parametrize("exc", [Interrupt, KeyboardInterrupt])
def test_interrupted_hf_to_mcore_leaves_nothing(exc, sharded_hf, tmp_path, monkeypatch):
    src = sharded_hf("qwen2-yarn", "fp32")
    real = legacy_format.write_rank_file
    calls = []

    def flaky(*args, **kwargs):
        calls.append(args)
        if len(calls) == 2:
            raise exc("killed mid-way")
        return real(*args, **kwargs)

    monkeypatch.setattr(legacy_format, "write_rank_file", flaky)
    out = tmp_path / "ckpt"
    with pytest.raises(exc):
        hf_to_mcore(src, str(out), tp=2, pp=2, progress=False, ckpt_format="legacy")
    assert len(calls) == 2
    assert not out.exists() and _leftovers(tmp_path, "ckpt") == []


def test_interrupted_mcore_to_hf_leaves_nothing(sharded_hf, tmp_path, monkeypatch):
    src = sharded_hf("llama-llama3", "fp32")
    hf_to_mcore(src, str(tmp_path / "ckpt"), progress=False)
    real = hf_io.save_file
    calls = []

    def flaky(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise Interrupt("disk full")
        return real(*args, **kwargs)

    monkeypatch.setattr(hf_io, "save_file", flaky)
    real_write = convert_lib.write_hf_checkpoint  # small shards, so that the failure is mid-way
    monkeypatch.setattr(convert_lib, "write_hf_checkpoint", lambda *a, **k: real_write(*a, max_shard_bytes=30_000, **k))
    with pytest.raises(Interrupt):
        mcore_to_hf(str(tmp_path / "ckpt"), str(tmp_path / "hf"), progress=False)
    assert len(calls) == 3
    assert not (tmp_path / "hf").exists() and _leftovers(tmp_path, "hf") == []


def test_failed_forced_conversion_keeps_the_old_output(sharded_hf, tmp_path, monkeypatch):
    src = sharded_hf("mistral", "fp32")
    out = tmp_path / "ckpt"
    hf_to_mcore(src, str(out), tp=1, progress=False, ckpt_format="legacy")
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}

    def boom(*args, **kwargs):
        raise Interrupt("killed")

    monkeypatch.setattr(legacy_format, "write_rank_file", boom)
    with pytest.raises(Interrupt):
        hf_to_mcore(src, str(out), tp=2, overwrite=True, progress=False, ckpt_format="legacy")
    after = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert after == before and _leftovers(tmp_path, "ckpt") == []


def test_library_refusals_raise_typed_errors(sharded_hf, tmp_path):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(OutputExistsError, match="--force"):
        hf_to_mcore(sharded_hf("mistral", "fp32"), str(tmp_path / "full"), progress=False)
    src = _write_config(tmp_path, "moe", dict(family_config("mistral"), model_type="deepseek_v2", n_routed_experts=4))
    with pytest.raises(UnsupportedModelError, match="deepseek_v2"):
        hf_to_mcore(str(src), str(tmp_path / "o"), progress=False)
    with pytest.raises(ValueError, match="--tp 4"):
        hf_to_mcore(sharded_hf("mistral", "fp32"), str(tmp_path / "o"), tp=4, progress=False)


# ------------------------------------------------------------------------------ torch_dist
def test_legacy_converts_to_torch_dist_and_back_with_every_tensor(sharded_hf, tmp_path):
    """A legacy TP=2 x PP=2 checkpoint rewritten as torch_dist holds the same tensors bit for bit
    (read back whole, and loaded by a model), and the CLI writes the legacy layout back."""
    src = sharded_hf("qwen3-tied", "bf16")
    legacy, dist_ckpt, again = tmp_path / "legacy", tmp_path / "dist", tmp_path / "again"
    hf_to_mcore(src, str(legacy), tp=2, pp=2, progress=False, ckpt_format="legacy")
    assert cli.main(["mcore-to-mcore", "--load", str(legacy), "--out-dir", str(dist_ckpt), "--no-progress"]) == 0
    assert (dist_ckpt / "release" / "metadata.json").exists() and not (dist_ckpt / "release" / "mp_rank_00_000").exists()
    _, a = load_full_state_dict(str(legacy))
    _, b = load_full_state_dict(str(dist_ckpt))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)
    assert cli.main(["mcore-to-mcore", "--load", str(dist_ckpt), "--out-dir", str(again), "--ckpt-format", "legacy",
                     "--tp", "2", "--no-progress"]) == 0
    _, c = load_full_state_dict(str(again))
    assert sorted(os.listdir(again / "release")) == ["checksums.sha256", "mp_rank_00", "mp_rank_01", "psrl_model.json"]
    assert all(torch.equal(a[k], c[k]) for k in a)
    back = tmp_path / "hf"
    assert cli.main(["mcore-to-hf", "--load", str(dist_ckpt), "--out-dir", str(back), "--no-progress"]) == 0
    x, y = read_hf_tensors(src), read_hf_tensors(str(back))
    assert set(x) == set(y) and all(torch.equal(x[k], y[k]) for k in x)


def _with_fp32_expert_biases(src, out):
    """A copy of the HF folder ``src`` whose routers' ``e_score_correction_bias`` are fp32 next to bf16
    weights (transformers keeps them fp32 in a bf16 model and saves them so), moved off the bf16
    grid so that a pass through bf16 would show."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, out)
    gen = torch.Generator().manual_seed(0)
    for f in sorted(os.listdir(out)):
        if f.endswith(".safetensors"):
            tensors = load_file(os.path.join(out, f))
            biases = [k for k in tensors if k.endswith("e_score_correction_bias")]
            for k in biases:
                tensors[k] = tensors[k].float() + 1e-4 * torch.randn(tensors[k].shape, generator=gen)
            if biases:
                save_file(tensors, os.path.join(out, f), metadata={"format": "pt"})
    return str(out)


@pytest.mark.parametrize("family", ["deepseek-v3-moe", "glm4-moe-qk-norm"])
def test_a_bf16_round_trip_keeps_the_expert_bias_dtype(family, sharded_hf, tmp_path):
    """megatron keeps the router's expert bias (``expert_bias``) in fp32 in a bf16 model; HF ->
    torch_dist -> HF gives it back in the folder's dtype, bit for bit: bf16 where the folder
    stored it so (``save_pretrained`` of a model cast to bf16), fp32 where it stored fp32 next to bf16
    weights. The legacy format, which keeps the converted tensors as they are, agrees."""
    bf16 = sharded_hf(family, "bf16")
    mixed = _with_fp32_expert_biases(bf16, tmp_path / "mixed")
    for src, bias_dtype in ((bf16, torch.bfloat16), (mixed, torch.float32)):
        a = read_hf_tensors(src)
        biases = sorted(k for k in a if k.endswith("e_score_correction_bias"))
        assert biases and all(a[k].dtype == bias_dtype for k in biases)
        assert a["model.embed_tokens.weight"].dtype == torch.bfloat16
        for fmt in ("torch_dist", "legacy"):
            ckpt, back = tmp_path / f"ckpt-{fmt}-{bias_dtype}", tmp_path / f"back-{fmt}-{bias_dtype}"
            info = hf_to_mcore(src, str(ckpt), progress=False, ckpt_format=fmt)
            assert info.dtype == "bfloat16"
            assert info.hf_dtypes == ({k: "bfloat16" for k in biases} if bias_dtype == torch.bfloat16 else {})
            if fmt == "torch_dist":  # megatron's buffer: fp32, the values of the folder's bias
                mcore = load_full_state_dict(str(ckpt))[1]
                layer = int(biases[0].split(".")[2])
                assert mcore[f"decoder.layers.{layer}.mlp.router.expert_bias"].dtype == torch.float32
            mcore_to_hf(str(ckpt), str(back), progress=False)
            b = read_hf_tensors(str(back))
            assert set(a) == set(b)
            for name in a:
                assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), (fmt, name)
