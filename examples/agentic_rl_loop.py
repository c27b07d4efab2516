"""A closed RL loop that learns: a tool-using agent, rollouts from transformers' ``generate``,
step-wise GRPO updates through ``PolicyActor``, with and without prefix sharing.

The environment is a key-value lookup over two turns. Each episode hides a random table that
maps 8 key tokens to 8 value tokens and asks for the value of one key::

    prompt : BOS <system prompt: 48 tokens> QUERY k
    turn 1 : the agent writes   LOOKUP x      the tool answers  RESULT table[x]  (ERROR ERROR if x is no key)
    turn 2 : the agent writes   ANSWER y      reward 0.5 [x == k] + 0.5 [y == table[k]]

The only way to the full reward is to look up the queried key and copy the tool's result:
the policy has to learn to use the tool. The loop is the one verl / slime run, with this project
as the update engine:

1. pre-training: a random Hugging Face Llama built in memory goes to ``PolicyActor`` without
   a file, and supervised steps (``log_likelihood_loss``, SFT on trajectories) on the episodes
   of a weak agent (well-formed, right half of the time) give a base policy that can sometimes
   do the task; its weights come back as an HF state dict;
2. RL: a new ``PolicyActor`` is built from that (config, state dict) in memory; every
   iteration its weights stream to a transformers model (``iter_hf_weights()``, tensor by
   tensor, as an RL framework syncs its inference engine), which samples G episodes per task
   with ``generate``;
3. every turn becomes a step-wise sample whose context is the whole history before it, with
   the group-normalised reward as its advantage (GRPO) and the rollout's log-probs as
   ``old_logprobs``; ``train_step`` takes one optimizer step and returns the log-probs it
   computed, so the train / rollout mismatch is logged without another pass.

The loop runs twice from the same seed, with prefix sharing and without (``prefix_sharing=
"none"``), prints both reward curves and the update phase's time of each, and checks what
holds on any machine (:func:`compare`):

- the first step agrees: the same rollouts (the same weights and seeds), and the loss, the
  gradient norm and every trained token's log-prob within float32 rounding (:data:`RTOL`);
- the rollouts, and so the rewards, are the same at every iteration whose weights still agree
  within float32 rounding (:data:`RTOL` of the largest weight). They part later: the two
  update engines sum in different orders, Adam's normalisation and the steps grow those last
  bits, and once the weights differ enough one sampled token differs (the same rollouts through
  iteration 14 on the machine the README's figures come from; on another CPU the iteration
  differs);
- both runs learn: the mean reward of the last iterations is at least :data:`LEARNED` above
  the first iterations';
- after the last step the weights differ by at most ``lr`` x iterations: Adam moves a weight by
  about ``lr`` per step, so the two runs end no further apart than one run's weights move.

``--plot`` writes the curves to a PNG. The exit status is 1 if a check fails.

    python examples/agentic_rl_loop.py --plot reward.png      # about 30 s on 2 quiet CPU cores
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional, Tuple

import numpy as np
import torch

# Token ids of the task's vocabulary (64 tokens).
BOS, QUERY, LOOKUP, RESULT, ANSWER, ERROR = 0, 1, 2, 3, 4, 5
NUM_KEYS = NUM_VALUES = 8
KEYS = np.arange(8, 8 + NUM_KEYS)
VALUES = np.arange(16, 16 + NUM_VALUES)
FILLER = np.arange(24, 64)  # the system prompt's words
VOCAB = 64

ULPS = 128
"""Float32 rounding between the two update engines, in ulps of ``max(1, |value|)``: summing n
terms in another order moves the sum by up to about n ulps of the terms' magnitudes, and the
sums here (a hidden size of 64 or 128, attention over at most 60 tokens) have n <= 128."""
RTOL = ULPS * float(np.finfo(np.float32).eps)
""":data:`ULPS` as a relative tolerance (2^-16)."""
LEARNED = 0.2
"""How far the mean reward of the last iterations must rise above the first iterations' to
count as learning (about 0.37 in the README's run; a policy that does not learn stays level)."""


@dataclass
class Episode:
    """One task instance: the hidden table and the queried key."""

    table: Dict[int, int]
    query: int

    @classmethod
    def sample(cls, rng: np.random.Generator) -> "Episode":
        return cls(dict(zip(KEYS.tolist(), rng.permutation(VALUES).tolist())), int(rng.choice(KEYS)))

    def tool(self, action: List[int]) -> List[int]:
        """The lookup tool's reply to the agent's first turn."""
        if action[0] == LOOKUP and action[1] in self.table:
            return [RESULT, self.table[action[1]]]
        return [ERROR, ERROR]

    def reward(self, lookup: List[int], answer: List[int]) -> float:
        """Verifiable reward of the episode: half for asking the tool the right question, half
        for the right answer."""
        asked = lookup[0] == LOOKUP and lookup[1] == self.query
        return 0.5 * asked + 0.5 * (answer[0] == ANSWER and answer[1] == self.table[self.query])


def prompt_tokens(system: List[int], episode: Episode) -> List[int]:
    return [BOS, *system, QUERY, episode.query]


def stepwise_samples(system: List[int], episode: Episode, turns: List[List[int]], observation: List[int],
                     advantage: float, rollout_logprobs: List[List[float]], tag: str) -> List[dict]:
    """Every agent turn as one sample whose context is the whole history before it."""
    history = prompt_tokens(system, episode)
    samples = []
    for t, (action, lps) in enumerate(zip(turns, rollout_logprobs)):
        tokens = history + action
        old = [0.0] * len(history) + list(lps)
        samples.append(dict(id=f"{tag}-turn{t}", tokens=tokens, loss_mask=[0] * len(history) + [1] * len(action),
                            advantage=advantage, old_logprobs=old))
        history = tokens + observation
    return samples


def random_policy_model(seed: int):
    """A random transformers Llama with the task's vocabulary (the 'pre-trained' policy)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=False, bos_token_id=BOS, eos_token_id=None, pad_token_id=BOS)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


class Sampler:
    """The inference engine: a transformers model, its weights synced from the actor."""

    def __init__(self, template):
        from transformers import LlamaForCausalLM

        self.model = LlamaForCausalLM(template.config).eval()

    @torch.no_grad()
    def sync(self, weights: Iterable[Tuple[str, torch.Tensor]]) -> None:
        """Copy streamed ``(HF name, tensor)`` pairs into the model one at a time, as vLLM and
        SGLang load weights: the actor never builds the whole state dict. Every parameter must
        arrive (a name the stream skipped would leave stale weights behind)."""
        params = self.model.state_dict()  # the live tensors, by name
        missing = set(params)
        for name, tensor in weights:
            params[name].copy_(tensor)
            missing.discard(name)
        if missing:
            raise RuntimeError(f"the weight stream did not send {sorted(missing)}")

    def flat_weights(self) -> torch.Tensor:
        """A copy of every weight in one flat tensor (a few hundred kB), to compare runs."""
        return torch.cat([t.detach().reshape(-1) for t in self.model.state_dict().values()])

    @torch.no_grad()
    def act(self, contexts: torch.Tensor, seed: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """Sample two tokens after every context (all of one length): actions and their log-probs."""
        torch.manual_seed(seed)
        out = self.model.generate(contexts, attention_mask=torch.ones_like(contexts), do_sample=True, top_k=0,
                                  top_p=1.0, temperature=1.0, max_new_tokens=2, min_new_tokens=2,
                                  output_logits=True, return_dict_in_generate=True, pad_token_id=BOS)
        actions = out.sequences[:, contexts.shape[1]:]
        logits = torch.stack(out.logits, dim=1).float()
        logprobs = torch.log_softmax(logits, -1).gather(-1, actions[..., None])[..., 0]
        return actions, logprobs


def rollout(sampler: Sampler, system: List[int], episodes: List[Episode], group_size: int, seed: int):
    """G episodes per task, two turns each: (samples, rewards [tasks, G])."""
    flat = [e for e in episodes for _ in range(group_size)]
    contexts = torch.tensor([prompt_tokens(system, e) for e in flat])
    first, first_lp = sampler.act(contexts, seed)
    observations = [e.tool(a.tolist()) for e, a in zip(flat, first)]
    contexts = torch.cat([contexts, first, torch.tensor(observations)], dim=1)
    second, second_lp = sampler.act(contexts, seed + 1)
    rewards = np.array([e.reward(a.tolist(), b.tolist()) for e, a, b in zip(flat, first, second)]).reshape(len(episodes), group_size)
    # GRPO: the reward normalised within the task's group is every turn's advantage.
    advantages = (rewards - rewards.mean(1, keepdims=True)) / (rewards.std(1, keepdims=True) + 1e-6)
    samples = []
    for i, e in enumerate(flat):
        samples += stepwise_samples(system, e, [first[i].tolist(), second[i].tolist()], observations[i],
                                    float(advantages.flat[i]), [first_lp[i].tolist(), second_lp[i].tolist()],
                                    tag=f"ep{i}")
    return samples, rewards


def demonstrations(system: List[int], rng: np.random.Generator, count: int, skill: float) -> List[dict]:
    """Episodes of a weak agent: always well-formed, but it asks for the queried key, and
    answers with the tool's result, only with probability ``skill`` each (random choices
    otherwise). Trained on them, the policy can sometimes do the task, as a base model can
    before RL."""
    samples = []
    for i in range(count):
        e = Episode.sample(rng)
        lookup = [LOOKUP, e.query if rng.random() < skill else int(rng.choice(KEYS))]
        result = e.tool(lookup)
        answer = [ANSWER, result[1] if rng.random() < skill else int(rng.choice(VALUES))]
        samples += stepwise_samples(system, e, [lookup, answer], result, 0.0, [[0.0, 0.0]] * 2, f"demo{i}")
    for s in samples:  # supervised samples: tokens and loss mask only
        del s["old_logprobs"], s["advantage"]
    return samples


def pretrain(args, system: List[int], log=print):
    """The base policy: a random transformers Llama built in memory, then supervised training
    (``log_likelihood_loss``, the SFT loss on trajectories) on a weak agent's episodes.
    Returns ``(hf_config, hf_state_dict)``: the weights as an RL framework would hold them."""
    from megatron_psrl import ActorConfig, OptimizerSettings, PolicyActor, log_likelihood_loss

    rng = np.random.default_rng(args.seed + 1)
    template = random_policy_model(args.seed)
    actor = PolicyActor(template, ActorConfig(  # from the model object: no file written
        micro_batch_tokens=args.micro_batch_tokens, device="cpu", memory_tracking="off",
        optimizer=OptimizerSettings(lr=args.pretrain_lr, min_lr=args.pretrain_lr)))
    t0 = time.perf_counter()
    for step in range(args.pretrain_steps):
        m = actor.train_step(demonstrations(system, rng, args.tasks * args.group_size, args.pretrain_skill),
                             loss_fn=log_likelihood_loss, return_logprobs=False)
        if (step + 1) % 50 == 0 or step + 1 == args.pretrain_steps:
            log(f"[pre-training] step {step + 1:3d}/{args.pretrain_steps}  loss {m['loss']:.4f}  "
                f"({time.perf_counter() - t0:.1f} s)")
    return template.config.to_dict(), actor.state_dict_hf()


def run(prefix_sharing: str, base, system: List[int], args, log=print) -> Dict[str, list]:
    """``args.iterations`` GRPO iterations from the base policy, every random draw seeded."""
    from megatron_psrl import ActorConfig, OptimizerSettings, PolicyActor
    from megatron_psrl.rl.loss import LossConfig

    config = ActorConfig(micro_batch_tokens=args.micro_batch_tokens, prefix_sharing=prefix_sharing, device="cpu",
                         optimizer=OptimizerSettings(lr=args.lr, min_lr=args.lr, clip_grad=1.0, adam_eps=args.adam_eps),
                         loss=LossConfig(clip_eps=0.2, loss_agg="token-mean"), memory_tracking="off")
    actor = PolicyActor(base, config)  # from (config, state_dict) in memory
    sampler = Sampler(random_policy_model(args.seed))
    rng = np.random.default_rng(args.seed + 2)
    history: Dict[str, list] = {"reward": [], "loss": [], "grad_norm": [], "update_s": [], "mismatch": [],
                                "tokens": [], "unique_tokens": [], "rollout": [], "weights": []}
    for it in range(args.iterations):
        sampler.sync(actor.iter_hf_weights())  # streamed, tensor by tensor
        history["weights"].append(sampler.flat_weights())  # what this iteration samples with
        episodes = [Episode.sample(rng) for _ in range(args.tasks)]
        samples, rewards = rollout(sampler, system, episodes, args.group_size, seed=args.seed * 1000 + 2 * it)
        # A digest of every sampled token: rollouts are the same iff the digests are.
        history["rollout"].append(hashlib.sha1(np.concatenate([s["tokens"] for s in samples]).tobytes()).hexdigest())
        t0 = time.perf_counter()
        metrics = actor.train_step(samples)
        update = time.perf_counter() - t0
        if it == 0:  # the first step's log-prob of every trained token (the others are not computed)
            history["first_logprobs"] = np.concatenate([lp[np.asarray(s["loss_mask"], bool)]
                                                        for lp, s in zip(metrics["logprobs"], samples)])
        # The train / rollout mismatch, from the log-probs the step returned (no second pass).
        mismatch = max(float(np.max(np.abs(lp - np.asarray(s["old_logprobs"]))[np.asarray(s["loss_mask"], bool)]))
                       for lp, s in zip(metrics["logprobs"], samples))
        history["reward"].append(float(rewards.mean()))
        history["loss"].append(float(metrics["loss"]))
        history["grad_norm"].append(float(metrics["grad_norm"]))
        history["update_s"].append(update)
        history["mismatch"].append(mismatch)
        history["tokens"].append(int(metrics["tokens_total"]))
        history["unique_tokens"].append(int(metrics["tokens_unique"]))
        log(f"[{prefix_sharing:>4}] iteration {it + 1:3d}  mean reward {rewards.mean():.3f}  loss "
            f"{metrics['loss']:+.2e}  grad norm {metrics['grad_norm']:.4f}  update {update:.3f} s ({metrics['tokens_total']} tokens, "
            f"{metrics['tokens_unique']} unique)  train/rollout log-prob mismatch {mismatch:.1e}")
    sampler.sync(actor.iter_hf_weights())
    history["weights"].append(sampler.flat_weights())  # after the last step
    return history


def summarize(main_run: Dict[str, list], plain: Optional[Dict[str, list]], window: int, lr: float) -> Dict[str, Any]:
    """The reward curve of ``main_run`` (the first and last ``window`` iterations' mean) and, given
    the run without sharing from the same seed (``plain``), the checks of :func:`compare`."""
    r = np.asarray(main_run["reward"])
    out = {"reward_first": float(r[:window].mean()), "reward_last": float(r[-window:].mean()),
           "update_s_shared": float(np.median(main_run["update_s"]))}
    if plain is not None:
        out.update(compare(main_run, plain, window, lr))
        out["update_s_none"] = float(np.median(plain["update_s"]))
        out["update_speedup"] = out["update_s_none"] / out["update_s_shared"]
    return out


def _ulps(a, b) -> float:
    """The largest ``|a - b|`` in float32 ulps of ``max(1, |a|, |b|)``."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    scale = np.maximum(1.0, np.maximum(np.abs(a), np.abs(b))) * np.finfo(np.float32).eps
    return float(np.max(np.abs(a - b) / scale))


def compare(shared: Dict[str, list], plain: Dict[str, list], window: int, lr: float) -> Dict[str, Any]:
    """What holds between prefix sharing on and off from the same seed on any machine, each check
    a bool with the figures it rests on: the first step agrees within float32 rounding; the
    rollouts are the same at every iteration whose weights agree within rounding; both runs
    learn; the final weights differ by at most ``lr`` x iterations."""
    iterations = len(shared["reward"])
    out: Dict[str, Any] = {}
    # The first step: the same weights and seeds, so the same rollouts bit for bit; the two
    # update engines then compute the same sums in other orders.
    first_same = shared["rollout"][0] == plain["rollout"][0]
    out["first_step_ulps"] = max(_ulps(shared["loss"][0], plain["loss"][0]),
                                 _ulps(shared["grad_norm"][0], plain["grad_norm"][0]),
                                 _ulps(shared["first_logprobs"], plain["first_logprobs"]) if first_same else np.inf)
    out["first_step_agrees"] = first_same and out["first_step_ulps"] <= ULPS
    # Rollouts are a function of the weights (seeds fixed): the same while the weights are.
    diffs = [float((a - b).abs().max()) for a, b in zip(shared["weights"], plain["weights"])]
    out["weight_rounding"] = RTOL * float(shared["weights"][0].abs().max())
    out["weights_within_rounding"] = next((i for i, d in enumerate(diffs[:iterations]) if d > out["weight_rounding"]),
                                          iterations)  # leading iterations that start within rounding
    out["same_rollouts"] = next((i for i, (a, b) in enumerate(zip(shared["rollout"], plain["rollout"])) if a != b),
                                iterations)  # leading iterations with the same rollouts
    out["rollouts_agree"] = out["same_rollouts"] >= out["weights_within_rounding"]
    for name, run in (("shared", shared), ("none", plain)):
        r = np.asarray(run["reward"])
        out[f"reward_first_{name}"], out[f"reward_last_{name}"] = float(r[:window].mean()), float(r[-window:].mean())
    out["both_learn"] = all(out[f"reward_last_{n}"] - out[f"reward_first_{n}"] >= LEARNED for n in ("shared", "none"))
    out["max_weight_diff"], out["weight_bound"] = diffs[-1], lr * iterations
    out["weights_within_bound"] = out["max_weight_diff"] <= out["weight_bound"]
    out["max_weight"] = float(plain["weights"][-1].abs().max())
    out["max_weight_moved"] = float((shared["weights"][-1] - shared["weights"][0]).abs().max())
    out["checks_pass"] = bool(out["first_step_agrees"] and out["rollouts_agree"] and out["both_learn"]
                              and out["weights_within_bound"])
    return out


def report(summary: Dict[str, Any], iterations: int, window: int) -> None:
    """Print :func:`compare`'s checks, each with its figures."""
    s = summary

    def verdict(flag: bool) -> str:
        return "yes" if flag else "NO"

    print("prefix sharing on vs off from the same seed:")
    print(f"  first step: the same rollouts, and the loss, gradient norm and every trained token's log-prob within "
          f"{ULPS} float32 ulps: {verdict(s['first_step_agrees'])} (largest difference {s['first_step_ulps']:.1f} ulps)")
    parted = ", then they part" if s["same_rollouts"] < iterations else ""
    print(f"  the same rollouts, so the same reward, at every iteration that starts from weights equal within "
          f"float32 rounding ({ULPS} ulps of the largest weight: {s['weight_rounding']:.1e}): "
          f"{verdict(s['rollouts_agree'])} (weights within rounding for iterations 1-{s['weights_within_rounding']}, "
          f"the same rollouts through iteration {s['same_rollouts']}{parted})")
    print(f"  both runs learn (the mean reward of the last {window} iterations at least {LEARNED} above the first "
          f"{window}'s): {verdict(s['both_learn'])} (sharing {s['reward_first_shared']:.3f} -> "
          f"{s['reward_last_shared']:.3f}, none {s['reward_first_none']:.3f} -> {s['reward_last_none']:.3f})")
    print(f"  after {iterations} steps the weights differ by at most lr x iterations = {s['weight_bound']:.1e}: "
          f"{verdict(s['weights_within_bound'])} ({s['max_weight_diff']:.1e}; training moved them by up to "
          f"{s['max_weight_moved']:.1e}, the largest is {s['max_weight']:.2f})")


def plot(path: str, shared: Dict[str, list], plain: Optional[Dict[str, list]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 3.6))
    x = np.arange(1, len(shared["reward"]) + 1)
    ax.plot(x, shared["reward"], label="prefix sharing", lw=2)
    if plain is not None:
        ax.plot(x, plain["reward"], "--", label="no prefix sharing", lw=1.5)
    ax.axhline(1 / NUM_VALUES, color="grey", lw=0.8, ls=":", label="chance")
    ax.set(xlabel="iteration", ylabel="mean reward", title="key-value lookup agent (GRPO, step-wise)", ylim=(0, 1.05))
    ax.legend(loc="lower right")
    bx.plot(x, shared["update_s"], label="prefix sharing")
    if plain is not None:
        bx.plot(x, plain["update_s"], "--", label="no prefix sharing")
    bx.set(xlabel="iteration", ylabel="update time (s)", title="update phase per iteration", yscale="log")
    bx.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> Dict[str, float]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--iterations", type=int, default=40, help="GRPO iterations (default: %(default)s)")
    p.add_argument("--tasks", type=int, default=16, help="tasks (groups) per iteration (default: %(default)s)")
    p.add_argument("--group-size", type=int, default=8, help="episodes per task (default: %(default)s)")
    p.add_argument("--system-tokens", type=int, default=48, help="system prompt length (default: %(default)s)")
    p.add_argument("--pretrain-steps", type=int, default=150,
                   help="supervised steps on a weak agent's episodes (default: %(default)s)")
    p.add_argument("--pretrain-skill", type=float, default=0.5,
                   help="how often the weak agent does each right thing (default: %(default)s)")
    p.add_argument("--pretrain-lr", type=float, default=3e-3, help="(default: %(default)s)")
    p.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate of RL (default: %(default)s)")
    p.add_argument("--adam-eps", type=float, default=1e-8, help="(default: %(default)s)")
    p.add_argument("--micro-batch-tokens", type=int, default=2048, help="(default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="(default: %(default)s)")
    p.add_argument("--sharing", choices=["both", "tree", "none"], default="both",
                   help="run with prefix sharing, without, or both from the same seed (default: %(default)s)")
    p.add_argument("--plot", help="write the reward curves to this PNG")
    p.add_argument("--json", help="write the curves and the summary to this JSON file")
    args = p.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    system = np.random.default_rng(args.seed).choice(FILLER, size=args.system_tokens).tolist()
    base = pretrain(args, system)
    shared = run("tree", base, system, args) if args.sharing != "none" else None
    plain = run("none", base, system, args) if args.sharing != "tree" else None
    main_run = shared or plain
    window = max(1, min(5, args.iterations // 4))
    summary = summarize(main_run, plain if shared else None, window, args.lr)
    print(f"\nmean reward: first iterations {summary['reward_first']:.3f} -> last iterations "
          f"{summary['reward_last']:.3f} (chance {1 / NUM_VALUES:.3f})")
    if "checks_pass" in summary:
        report(summary, args.iterations, window)
        print(f"update phase (median per iteration): sharing {summary['update_s_shared']:.3f} s, none "
              f"{summary['update_s_none']:.3f} s -> {summary['update_speedup']:.1f}x "
              f"({main_run['tokens'][0]} tokens, {main_run['unique_tokens'][0]} unique)")
    if args.plot:
        plot(args.plot, main_run, plain if shared else None)
        print(f"reward curves written to {args.plot}")
    if args.json:
        curves = {name: {k: v for k, v in run.items() if k not in ("weights", "first_logprobs")}
                  for name, run in (("shared", shared), ("none", plain)) if run is not None}
        with open(args.json, "w") as f:
            json.dump({"summary": summary, **curves}, f)
    return summary


if __name__ == "__main__":
    sys.exit(0 if main().get("checks_pass", True) else 1)
