"""verl's own replay buffers with a 0.2 s poll instead of their 2 s default, for the head-to-head's what-if.

Why: verl's replay buffer looks at TransferQueue every 2 s (a constructor default its trainers never pass), so
on a job whose steps take seconds every stock sample wait comes in 2 s steps, and trainer `tide` looks every
`tide.sample_poll_s` (0.2 s). A user can change verl's with a custom sampler (`trainer.v1.sampler.custom_sampler`,
these few lines); the head-to-head runs stock verl that way too, so the poll is not counted as tide's. Loaded by
file path through verl's `load_extern_type`: nothing here is imported by the product.
"""

from __future__ import annotations

from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer, ReplayBufferAsync

POLL_S = 0.2


class FastPollReplayBuffer(ReplayBuffer):
    """verl `sync`'s buffer."""

    def __init__(self, **kwargs):
        super().__init__(poll_interval=POLL_S, **kwargs)


class FastPollReplayBufferAsync(ReplayBufferAsync):
    """verl's asynchronous trainers' buffer."""

    def __init__(self, **kwargs):
        super().__init__(poll_interval=POLL_S, **kwargs)
