"""The precision a merged export is written in (lowmem_grpo.export.precision) and the batch its score decodes at once
(lowmem_grpo.export.score.scoring_batch): pure functions of tensors and the planner, no model."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")


def bf16_step(x: float) -> float:
    """The distance between neighbouring bfloat16 values around `x` (8 significant bits)."""
    return 2.0 ** (torch.floor(torch.log2(torch.tensor(abs(x)))).item() - 7)


def layer(weight, delta, name="layers.0.q_proj"):
    return name, weight.float(), delta.float()


def bf16_weights(g, rows: int = 64, cols: int = 64):
    """Weights of 0.02 to about 0.05 in size, either sign, stored in bfloat16 (on its grid)."""
    size = 0.02 + torch.randn(rows, cols, generator=g).abs() * 0.01
    return (size * torch.randn(rows, cols, generator=g).sign()).to(torch.bfloat16).float()


def test_a_change_below_bfloat16s_step_is_lost_on_a_bfloat16_base_and_float16_keeps_it():
    """A base stored in bfloat16 (every hub model the GPU recipes train) sits on bfloat16's grid: a change under half
    a step rounds back to the base weight."""
    from lowmem_grpo.export.precision import choose, measure

    g = torch.Generator().manual_seed(0)
    weight = bf16_weights(g)
    delta = torch.randn(64, 64, generator=g) * 0.02 * 2**-10  # far below bfloat16's relative step of 2^-8
    measured = measure([layer(weight, delta)])
    assert measured["bfloat16"].kept < 0.1 and not measured["bfloat16"].keeps
    assert measured["float16"].kept > 0.9 and measured["float16"].keeps
    assert measured["float32"].kept == pytest.approx(1.0, abs=1e-6) and measured["float32"].error < 1e-3
    choice = choose(measured)
    assert choice.dtype == "float16" and "bfloat16 keeps" in choice.reason


def test_weights_on_rounding_ties_make_noise_that_a_projection_alone_would_count_as_kept():
    """A float32 base whose weights sit halfway between two bfloat16 values (as a tenth of the embedded SmolLM2's do):
    any change moves them half a step its way. The projection says more than 100% kept; the error shows the noise."""
    from lowmem_grpo.export.precision import measure

    g = torch.Generator().manual_seed(1)
    grid = (torch.rand(64, 64, generator=g) * 0.02 + 0.02).to(torch.bfloat16).float()
    ties = grid + bf16_step(0.03) / 2 * (grid < 0.03125) + bf16_step(0.04) / 2 * (grid >= 0.03125)
    assert bool(((ties.view(torch.int32) & 0xFFFF) == 0x8000).all())  # the bits below bfloat16's: exactly a half
    delta = torch.randn(64, 64, generator=g) * 1e-6
    measured = measure([layer(ties, delta)])["bfloat16"]
    assert measured.kept > 1.5 and measured.error > 10 and not measured.keeps


def test_a_large_change_keeps_in_bfloat16_the_smallest_and_float16_overflow_is_refused():
    from lowmem_grpo.export.precision import SIXTEEN_BIT, choose, measure

    g = torch.Generator().manual_seed(2)
    weight = torch.randn(32, 32, generator=g) * 0.02
    delta = torch.randn(32, 32, generator=g) * 0.01  # half the weights' size: every precision keeps it
    measured = measure([layer(weight, delta)])
    assert all(k.keeps for k in measured.values())
    assert choose(measured).dtype == "bfloat16"
    big = weight.clone()
    big[0, 0] = 1e5  # above float16's largest value, 65504
    overflow = measure([layer(big, delta)])
    assert not overflow["float16"].finite and not overflow["float16"].keeps and overflow["bfloat16"].finite
    lost = measure([layer(bf16_weights(g, 32, 32), delta * 1e-5)], SIXTEEN_BIT)
    assert choose(lost, SIXTEEN_BIT) is None  # merged-16bit: neither 16-bit precision keeps it


def test_every_layer_must_keep_its_change():
    """One layer that loses its change fails the bound even when the others' larger changes dominate the total."""
    from lowmem_grpo.export.precision import measure

    g = torch.Generator().manual_seed(3)
    base = bf16_weights(g)
    kept = layer(base, torch.randn(64, 64, generator=g) * 0.01, "layers.0.up_proj")
    small = layer(base, torch.randn(64, 64, generator=g) * 0.02 * 2**-11, "layers.1.q_proj")
    measured = measure([kept, small])["bfloat16"]
    assert measured.kept > 0.99 and measured.worst_kept < 0.1 and measured.worst_layer == "layers.1.q_proj"
    assert not measured.keeps


def test_the_export_plans_its_scoring_batch_for_the_merged_model_on_the_gpu_it_has():
    """The calculator recipe's run planned its evaluation batch for the 4-bit training model on an 8 GB card; the
    merged model holds 16-bit weights (float32 where that keeps the adapter). The run's batch would not fit; the
    export's own does, and on the CPU (no plan of GPU memory) the export keeps the run's."""
    from lowmem_grpo.device import CudaFacts
    from lowmem_grpo.export.score import scoring_batch
    from lowmem_grpo.memory.arch import load_architecture
    from lowmem_grpo.memory.fit import with_planned_eval_batch
    from lowmem_grpo.memory.plan import device_budget, evaluation_peak, scoring_settings
    from lowmem_grpo.memory.terms import GIB
    from lowmem_grpo.recipe_io import load_recipe

    recipe = load_recipe("recipes/qwen2_5_1_5b_gsm8k_calc.py")
    arch = load_architecture(recipe.model.name, allow_hub=False)
    card = CudaFacts(torch_cuda="12.4", available=True, capability=(8, 6), free_bytes=int(7.5 * GIB),
                     total_bytes=8 * GIB)
    budget = device_budget(card.free_bytes, card.total_bytes)
    run = with_planned_eval_batch(recipe, budget, set(), arch=arch)  # what training wrote into recipe.yaml
    planned = run.train.eval.batch_size
    sixteen = scoring_settings(2, recipe.data.max_prompt_length, recipe.train.max_completion_length)
    assert evaluation_peak(arch, sixteen, planned) > budget  # the run's batch with the merged weights: out of memory
    batch = scoring_batch(run, recipe.model.name, "bfloat16", "cuda", facts=card)
    assert batch < planned and evaluation_peak(arch, sixteen, batch) <= budget
    assert evaluation_peak(arch, sixteen, batch * 2) > budget  # the largest that fits, not merely a small one
    wide = scoring_batch(run, recipe.model.name, "float32", "cuda", facts=card)
    thirty_two = scoring_settings(4, recipe.data.max_prompt_length, recipe.train.max_completion_length)
    assert wide < batch and evaluation_peak(arch, thirty_two, wide) <= budget
    roomy = CudaFacts(torch_cuda="12.4", available=True, capability=(8, 9), free_bytes=23 * GIB, total_bytes=24 * GIB)
    assert scoring_batch(run, recipe.model.name, "bfloat16", "cuda", facts=roomy) == planned  # never above the run's
    assert scoring_batch(run, recipe.model.name, "bfloat16", "cpu", facts=card) == planned


def test_the_float32_stage_moves_to_the_cpu_when_the_gpu_cannot_hold_it():
    """The exact adapter effect needs the base in float32: 1.5B parameters are 6.2 GB, beyond an 8 GB card's free
    memory with headroom, within a 24 GB card's."""
    from lowmem_grpo.export.merged import REFERENCE_HEADROOM, reference_device
    from lowmem_grpo.memory.terms import GIB

    params = 1_543_714_304  # Qwen2.5-1.5B
    card_free = 7 * GIB  # an 8 GB card after the CUDA context
    assert params * 4 * REFERENCE_HEADROOM > card_free
    assert reference_device("cuda", params, card_free) == "cpu"
    assert reference_device("cuda", params, 23 * GIB) == "cuda"
    assert reference_device("cpu", params, None) == "cpu"
