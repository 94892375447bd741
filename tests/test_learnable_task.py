"""The learning-parity benchmark's task (`tiny_learn`, benchmarks/learning_parity.py) is learnable by the tiny
model at all: a few GRPO-style policy-gradient steps (the benchmark's learning rate and group size, plain torch, no
verl) raise its reward above what the random policy gets. The benchmark itself, through verl and trainer tide,
is not a test: it takes half an hour."""

from __future__ import annotations

from statistics import mean

import pytest

from verl_tide.env.envs import LEARN_HIGH, PRESETS, make_environment


def _episode_reward(reply: str, seed: int) -> float:
    """The reward the environment gives this reply as the first turn of a `tiny_learn` episode."""
    env = make_environment("tiny_learn", seed)
    env.reset({"low": 1, "high": LEARN_HIGH})
    _, reward, _, _ = env.step(reply)
    return reward


def test_the_preset_grades_answers_by_their_share_of_digits():
    assert PRESETS["tiny_learn"].step_latency_s > 0  # the demo's environment pace
    no_number, some, only = (_episode_reward(r, seed=1) for r in ("abc", "ab 12", "1234"))
    assert (no_number, some, only) == (0.0, 0.4, 1.0)  # the answer's share of digits


def test_a_few_policy_gradient_steps_raise_the_tiny_models_reward(tiny_model_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(str(tiny_model_path))
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_path), torch_dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    prompt = tok.apply_chat_template(
        [{"role": "system", "content": "Play the game. Answer with one number."},
         {"role": "user", "content": f"Find the hidden number between 1 and {LEARN_HIGH}. Answer with one number "
                                     "per turn."}],
        add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    rewards_by_step = []
    for step in range(8):
        with torch.no_grad():
            out = model.generate(prompt.repeat(16, 1), do_sample=True, max_new_tokens=8, temperature=1.0,
                                 pad_token_id=tok.pad_token_id)
        replies = out[:, prompt.shape[1]:]
        texts = tok.batch_decode(replies, skip_special_tokens=True)
        rewards = torch.tensor([_episode_reward(t, seed=step * 100 + i) for i, t in enumerate(texts)])
        rewards_by_step.append(rewards.mean().item())
        adv = (rewards - rewards.mean()) / (rewards.std() + 1e-6)
        logits = model(out).logits[:, prompt.shape[1] - 1:-1]
        logp = torch.log_softmax(logits, -1).gather(-1, replies.unsqueeze(-1)).squeeze(-1)
        mask = (replies != tok.pad_token_id).float()
        loss = -(adv[:, None] * logp * mask).sum() / mask.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    first, last = mean(rewards_by_step[:2]), mean(rewards_by_step[-2:])
    assert last > first + 0.1, rewards_by_step  # (a turn scores at most 1)
