"""The small GPT's summed, masked training loss and every parameter's gradient on the CPU,
for tests that compare a fused op's model with the unfused one."""

import torch

from pytrain.model.gpt import GPT, ModelConfig


def loss_and_grads(
    checkpoint_every: int = 0, **model
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A 2-layer GPT (seed 0, vocabulary 200, d_model 32) with the `model` settings, one
    batch of 2 x 16 tokens with about a fifth masked out of the loss (seed 1); with
    `checkpoint_every`, blocks recompute their activations in the backward."""
    torch.manual_seed(0)
    m = GPT(ModelConfig(vocab_size=200, n_layer=2, n_head=2, d_model=32, **model)).train()
    m.set_activation_checkpointing(checkpoint_every)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 200, (2, 16), generator=g)
    targets = torch.randint(0, 200, (2, 16), generator=g)
    keep = torch.rand(2, 16, generator=g) > 0.2
    loss = m.loss_sum(ids, targets, None, keep, None)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in m.named_parameters() if p.grad is not None}


def assert_same_loss_and_grads(got, want) -> None:
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    assert got[1].keys() == want[1].keys()
    for name, grad in want[1].items():
        torch.testing.assert_close(got[1][name], grad, rtol=1e-4, atol=1e-6, msg=name)
