"""Weight streaming (megatron_psrl.engine.weights): the policy's weights leave the actor one
Hugging Face tensor at a time, gathered over tensor- and pipeline-parallel ranks a bucket at a
time. What is streamed is a copy of the model: bit for bit the Hugging Face checkpoint the
actor was loaded from (same names, shapes, dtypes, bytes), on every rank, at 1 rank and under
torchrun with TP=2 and PP=2 (virtual stages); and a rank's host memory while streaming stays
near one bucket, not the model."""

import glob
import os

import pytest
import torch
from helpers.families import FAMILIES, PARALLEL_CONFIGS, family_config, make_family_checkpoint
from helpers.torchrun import REPO_ROOT, SharedLaunches, selected_test_names
from safetensors.torch import load_file

from megatron_psrl import ActorConfig, PolicyActor
from megatron_psrl.checkpoint.state_dict import canonical_state_dict
from megatron_psrl.engine.memory import PeakMemory, heap_bytes_in_use
from megatron_psrl.engine.weights import WeightStream, iter_hf_weight_buckets, iter_hf_weights
from megatron_psrl.model import ModelArchitecture
from megatron_psrl.model.adapters import get_adapter

SCRIPT = os.path.join(REPO_ROOT, "tests", "training", "scripts", "weight_stream.py")


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (``torch.equal`` would call -0.0 and 0.0 equal)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def read_hf(directory: str) -> dict:
    """Every tensor of a safetensors folder, read with safetensors itself (not our reader)."""
    out = {}
    for path in sorted(glob.glob(os.path.join(directory, "*.safetensors"))):
        out.update(load_file(path))
    return out


def actor_of(hf_dir: str, **config) -> PolicyActor:
    return PolicyActor(hf_dir, ActorConfig(device="cpu", memory_tracking="off", **config), for_training=False)


def check_buckets(buckets, stream, bucket_bytes):
    """Buckets regroup the stream in order; each at most ``bucket_bytes`` or one tensor."""
    assert [n for b in buckets for n, _ in b] == [n for n, _ in stream]
    for b in buckets:
        size = sum(t.numel() * t.element_size() for _, t in b)
        assert size <= bucket_bytes or len(b) == 1, (size, [n for n, _ in b])
    assert any(len(b) > 1 for b in buckets) and len(buckets) > 1
    tensors = dict(stream)
    assert all(bits_equal(t, tensors[n]) for b in buckets for n, t in b)


# ---------------------------------------------------------------------------------- 1 rank
@pytest.mark.parametrize("family", FAMILIES + ("deepseek-v3",))
def test_stream_is_the_checkpoint_bit_for_bit(family, tmp_path):
    hf_dir = make_family_checkpoint(family_config(family), str(tmp_path / "hf"))
    reference = read_hf(hf_dir)
    actor = actor_of(hf_dir)
    # What state_dict_hf returned before streaming (one rank: the whole model's state dict
    # converted at once), as the order and content the stream must keep.
    before = dict(get_adapter(actor.arch).mcore_to_hf(
        {k: v.clone() for k, v in canonical_state_dict(actor.model).items()}))
    bucket_bytes = 20000  # a few tensors per bucket; the embedding (77 kB) alone
    stream = list(actor.iter_hf_weights(bucket_bytes=bucket_bytes))
    assert [n for n, _ in stream] == list(before)
    assert sorted(before) == sorted(reference)
    for name, tensor in stream:
        assert bits_equal(tensor, reference[name]), name
        assert bits_equal(tensor, before[name]), name
    check_buckets(list(iter_hf_weight_buckets(actor.engine, bucket_bytes)), stream, bucket_bytes)

    # One bucket for everything, and the dict and file forms, are the same stream.
    whole = actor.state_dict_hf()
    assert list(whole) == list(before)
    assert all(bits_equal(t, whole[n]) for n, t in iter_hf_weights(actor.engine, bucket_bytes=1 << 40))
    actor.export_hf(str(tmp_path / "export"))
    exported = read_hf(str(tmp_path / "export"))
    assert sorted(exported) == sorted(reference)
    assert all(bits_equal(exported[n], t) for n, t in reference.items())
    full = actor.full_state_dict()
    own = canonical_state_dict(actor.model)
    assert sorted(full) == sorted(own) and all(bits_equal(full[n], t) for n, t in own.items())

    # Snapshots, not views: changing the live parameters afterwards changes none of them.
    with torch.no_grad():
        for p in actor.model.parameters():
            p.add_(1.0)
    for name, tensor in stream:
        assert bits_equal(tensor, reference[name]) and bits_equal(whole[name], reference[name]), name
    assert all(bits_equal(full[n], t) for n, t in canonical_state_dict(actor_of(hf_dir).model).items())


def test_bfloat16_weights_stream_in_bfloat16(tmp_path):
    hf_dir = make_family_checkpoint(family_config("qwen2-yarn"), str(tmp_path / "hf"), dtype=torch.bfloat16)
    reference = read_hf(hf_dir)
    stream = dict(actor_of(hf_dir, dtype="bfloat16").iter_hf_weights(bucket_bytes=4096))
    assert sorted(stream) == sorted(reference)
    for name, tensor in stream.items():
        assert tensor.dtype == torch.bfloat16 and bits_equal(tensor, reference[name]), name


def test_split_dimension_comes_from_the_parameters(tmp_path):
    """A parameter whose tensor-parallel attributes disagree with the merge rules must stop
    the stream (its shards would be concatenated wrongly), not stream a wrong tensor."""
    actor = actor_of("tiny-qwen3")
    qkv = actor.model.decoder.layers[0].self_attention.linear_qkv.weight
    qkv.partition_dim = 1
    with pytest.raises(RuntimeError, match="partition_dim=1"):
        next(actor.iter_hf_weights())
    qkv.partition_dim = 0
    norm = actor.model.decoder.layers[0].input_layernorm.weight
    norm.tensor_model_parallel = True
    with pytest.raises(RuntimeError, match="tensor_model_parallel=True"):
        next(actor.iter_hf_weights())
    del norm.tensor_model_parallel
    assert len(list(actor.iter_hf_weights())) == len(get_adapter(actor.arch).hf_keys())
    with pytest.raises(ValueError, match="bucket_bytes"):
        next(actor.iter_hf_weights(bucket_bytes=0))


# ---------------------------------------------------------------------------------- memory
MEMORY_CONFIG = family_config("llama-llama3", hidden_size=512, intermediate_size=2048, num_hidden_layers=8,
                              num_attention_heads=8, num_key_value_heads=4, head_dim=64, vocab_size=1024)
"""About 130 MB in fp32, whose largest tensor (a fused gate/up weight, 8 MB) is a sixteenth of it."""


def check_memory(stream_peak, whole_peak, model_bytes, largest, bucket_bytes):
    # What the stream holds at its peak (measured 1.8x the largest tensor at 1 rank, 2.3x on a
    # TP=2 rank, with 1 MB buckets): one bucket, or the largest tensor alone, twice while it is
    # merged (gathered shards and the merged copy; at 1 rank the copy that makes a snapshot),
    # plus the previous layer's fused gate/up weight, which the adapter's conversion generator
    # still references until its next layer, plus one layer's q/k/v split.
    assert stream_peak <= 2 * max(bucket_bytes, largest) + 1.5 * largest, (stream_peak, bucket_bytes, largest)
    assert stream_peak < 0.3 * model_bytes, (stream_peak, model_bytes)
    # The same measurement sees a whole model kept (it would see an all-gathered one).
    assert whole_peak >= 0.9 * model_bytes, (whole_peak, model_bytes)


@pytest.mark.fresh_process
def test_streaming_holds_about_one_bucket(tmp_path):
    """Measured, not by construction: the C heap's bytes in use (which torch's CPU tensors come
    from: glibc mallinfo2), read after every torch operation (PeakMemory "ops"), so the figure
    is exact on any CPU and blind to what Python objects or other libraries hold; the consumer
    drops each tensor, as a rollout engine that copies it into its own weights does."""
    if heap_bytes_in_use() is None:
        pytest.skip("needs glibc's mallinfo2 to measure the heap")
    actor = actor_of(make_family_checkpoint(MEMORY_CONFIG, str(tmp_path / "hf")))
    bucket_bytes = 1 << 20
    largest = max(e.nbytes for e in WeightStream(actor.engine).entries.values())
    count = 0
    with PeakMemory(torch.device("cpu"), mode="ops") as streaming:
        for _, tensor in actor.iter_hf_weights(bucket_bytes=bucket_bytes):
            count += 1
            del tensor
    with PeakMemory(torch.device("cpu"), mode="ops") as whole:
        weights = actor.state_dict_hf()
    assert count == len(weights)
    model_bytes = sum(t.numel() * t.element_size() for t in weights.values())
    check_memory(streaming.peak_bytes - streaming.start_bytes, whole.peak_bytes - whole.start_bytes, model_bytes,
                 largest, bucket_bytes)


# ---------------------------------------------------------------------------------- torchrun
LAYOUTS = {"tp2": ["--tp", "2", "--pp", "1"], "pp2-vpp2": ["--tp", "1", "--pp", "2", "--vpp-layers", "1"]}
MODELS = {"llama": PARALLEL_CONFIGS["llama"], "qwen3": PARALLEL_CONFIGS["qwen3"],
          "qwen2-untied": family_config("qwen2-yarn", tie_word_embeddings=False, vocab_size=251)}


@pytest.fixture(scope="module")
def parallel_runs(tmp_path_factory, request):
    """Both layouts (2 ranks, gloo) in one torchrun launch, TP=2 first (its rank memory is
    measured in a process that has run nothing else), their results read back; models of 4
    layers (PP=2 with one layer per virtual stage: 2 chunks per rank) and an odd vocabulary
    (TP pads it)."""
    root = tmp_path_factory.mktemp("stream")
    dirs = {name: make_family_checkpoint(dict(cfg, num_hidden_layers=4), str(root / name), seed=3)
            for name, cfg in MODELS.items()}
    memory_dir = make_family_checkpoint(MEMORY_CONFIG, str(root / "memory"))
    selected = selected_test_names(request)
    wanted = {layout for layout in LAYOUTS if f"test_every_rank_streams_the_full_model[{layout}]" in selected}
    if "test_a_tensor_parallel_rank_streams_within_about_one_bucket" in selected:
        wanted.add("tp2")
    shared = SharedLaunches(wanted)
    for layout in LAYOUTS:  # (TP=2 first)
        def make_args(layout=layout):
            out = root / layout
            out.mkdir()
            extra = ["--memory-hf-dir", memory_dir] if layout == "tp2" else []
            return [*LAYOUTS[layout], "--bucket-bytes", "20000", "--out", str(out), *extra,
                    *[f"--hf-dir={n}={d}" for n, d in dirs.items()]]

        shared.add(layout, 2, SCRIPT, make_args)

    def run(layout):
        shared.check(layout)
        return root / layout, dirs

    return run


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_rank_streams_the_full_model(parallel_runs, layout):
    out, dirs = parallel_runs(layout)
    for name, hf_dir in dirs.items():
        reference = read_hf(hf_dir)
        own = dict(get_adapter(ModelArchitecture.from_hf_dir(hf_dir)).hf_to_mcore(reference.__getitem__))
        for rank in range(2):
            got = torch.load(out / f"{name}-rank{rank}.pt", weights_only=False)
            if layout == "pp2-vpp2":
                assert got["chunks"] == 2
            assert sorted(got["names"]) == sorted(reference), (name, rank)
            for n in got["names"]:
                assert bits_equal(got["tensors"][n], reference[n]), (layout, name, rank, n)
            check_buckets(got["buckets"], [(n, got["tensors"][n]) for n in got["names"]], 20000)
            assert sorted(got["full"]) == sorted(own), (name, rank)
            assert all(bits_equal(got["full"][n], t) for n, t in own.items()), (name, rank)
        assert [*torch.load(out / f"{name}-rank0.pt", weights_only=False)["names"]] == \
            [*torch.load(out / f"{name}-rank1.pt", weights_only=False)["names"]]
        exported = read_hf(str(out / f"{name}-export"))
        assert sorted(exported) == sorted(reference)
        assert all(bits_equal(exported[n], t) for n, t in reference.items()), (layout, name)


@pytest.mark.slow
def test_a_tensor_parallel_rank_streams_within_about_one_bucket(parallel_runs):
    """As test_streaming_holds_about_one_bucket, on each rank of TP=2: the gathered shards and
    merged tensors of one bucket at a time, not the model (nor the all-gathered rank shards)."""
    out, _ = parallel_runs("tp2")
    files = sorted(out.glob("memory-rank*.pt"))
    if not files:
        pytest.skip("needs glibc's mallinfo2 to measure the heap")
    for f in files:
        m = torch.load(f, weights_only=False)
        assert m["own_bytes"] < 0.6 * m["model_bytes"]  # each rank holds half of every matrix
        check_memory(m["stream_peak"], m["whole_peak"], m["model_bytes"], m["largest"], m["bucket_bytes"])
