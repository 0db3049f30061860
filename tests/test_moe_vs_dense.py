"""benchmarks/moe_vs_dense.py: the rule fixed before the GPU runs, and the step size it reads
from a run's command."""

from conftest import load_script

mvd = load_script("benchmarks/moe_vs_dense.py", "moe_vs_dense")


def test_the_moe_learns_better_only_where_it_wins_every_seed_by_more_than_dense_spread():
    assert mvd.decide([(3.00, 2.90), (3.02, 2.93)]).startswith("the MoE learns better")
    # Lower on both seeds, but by less than dense's own spread across them.
    assert mvd.decide([(3.00, 2.99), (3.05, 3.04)]).startswith("NOT shown: the MoE lower on 2")
    assert mvd.decide([(3.00, 2.90), (3.02, 3.03)]).startswith("NOT shown: the MoE lower on 1")
    assert mvd.decide([(3.00, 2.50)]).startswith("undecided: 1 seed(s)")


def test_tokens_a_step_are_the_commands_last_setting():
    cmd = mvd.command(mvd.Path("w"), "moe", 1, 10, ["--optim.tokens_per_step", "256"])
    assert mvd.tokens_per_step(cmd) == 256
    assert mvd.tokens_per_step(mvd.command(mvd.Path("w"), "dense", 1, 10, [])) == 65536
    assert "--model.experts" in cmd and "--model.experts" not in mvd.command(
        mvd.Path("w"), "dense", 1, 10, []
    )
