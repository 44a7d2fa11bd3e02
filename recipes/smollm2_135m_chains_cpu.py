"""SmolLM2-135M-Instruct on generated one- and two-step word problems, CPU: chains of calculations, no GPU, no hub.

Run:      lowmem-grpo train recipes/smollm2_135m_chains_cpu.py
          python recipes/smollm2_135m_chains_cpu.py train.max_steps=5
Hardware: a 2-core CPU with 8 GB of RAM; model.dtype=auto trains in bfloat16 on a CPU with native bfloat16 and in
          float32 on an AVX2-only CPU.
What:     recipes/smollm2_135m_arith_cpu.py (what `make demo` trains: the calculator in the loop, correctness
          rewarded, a KL anchor to the primed adapter) on chains: priming on 320 worked solutions, half one-step
          and half two-step, each calculation on its own line with the calculator's annotation, for 40 steps; then
          30 GRPO steps on a mix of a quarter one-step and three quarters two-step problems, each group's advantages
          scaled by its own spread (TRL's `scale_rewards=group`; the default scales by the batch's); an 80-token
          budget every worked chain finishes within (the longest takes 61 tokens; `lowmem-grpo validate` checks it).
          The stage evaluation splits its 100 held-out problems by number of steps and says where each chain broke.
Measured: GRPO's own gain (trained - primed, greedy, 300 held-out problems each, paired 95% CI) on training seeds
          42 / 7 / 101: two steps +20.3 / +11.0 / +24.7, one step +7.7 / +6.0 / +4.7, every CI above 0
          (`python benchmarks/seeds.py table`, configuration chains-group); training (priming and GRPO) 13-16 minutes and
          4.2-4.6 GiB peak RSS on a 2-core native-bf16 CPU without AMX. Scaled by the batch's spread, as the default
          does, seed 7 lost 9.3 points on one step. docs/results.md, "GRPO's own gain over training seeds".
"""

from dataclasses import replace
from pathlib import Path

from lowmem_grpo.recipe import Recipe
from lowmem_grpo.recipe_io import load_recipe

DEFAULT = Path(__file__).with_name("smollm2_135m_arith_cpu.py")
# what this recipe changes of the CPU default: the overrides the chains sweep measured (results/chains-bf16/)
CHAINS = ["data.generated.levels=1,2", "data.generated.grpo_levels=1,2,2,2", "prime.num_examples=320",
          "prime.max_steps=40", "train.max_completion_length=80",
          # per-group scaling: a one-step group that rarely fails still teaches when it does (seeds 7, 42, 101)
          "train.scale_rewards=group"]


def recipe() -> Recipe:
    """The CPU default on one- and two-step problems: longer priming, GRPO weighted to two steps."""
    return replace(load_recipe(str(DEFAULT), CHAINS), name="smollm2-135m-chains-cpu",
                   description="SmolLM2-135M-Instruct on generated one- and two-step problems, CPU: chains")


if __name__ == "__main__":
    from lowmem_grpo.cli import main_for_recipe

    raise SystemExit(main_for_recipe(__file__))
