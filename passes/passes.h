// Factories of every pass (one line each; see passes/registry.cpp).
#pragma once
#include <memory>

#include "passes/pass.h"

namespace kiln::passes {

/// Re-runs type inference, removes Identity nodes and dead code.
std::unique_ptr<Pass> make_canonicalize_pass();
/// Evaluates nodes with constant inputs (shape subgraphs) into initializers (passes/fold_constants.cpp).
std::unique_ptr<Pass> make_fold_constants_pass();
/// Adds the loss and makes trainable initializers state inputs (passes/attach_loss.cpp).
std::unique_ptr<Pass> make_attach_loss_pass();
/// Reverse-mode differentiation over the op table (passes/autodiff.cpp).
std::unique_ptr<Pass> make_autodiff_pass();
/// Clipping, LR schedule and AdamW/SGD update as IR (passes/optimizer.cpp).
std::unique_ptr<Pass> make_optimizer_pass();
/// Gradient accumulation: wraps forward and backward in an AccumulationLoop region.
std::unique_ptr<Pass> make_accumulation_pass();
std::unique_ptr<Pass> make_data_parallel_pass();  ///< passes/data_parallel.cpp
/// Inference mode: BatchNormalization uses running stats, Dropout off (passes/eval_mode.cpp).
std::unique_ptr<Pass> make_eval_mode_pass();
/// bf16 (or f16, AutocastOptions::dtype) mixed precision from the op table's PrecisionPolicy,
/// before autodiff (passes/autocast.cpp).
std::unique_ptr<Pass> make_autocast_pass();
/// After autodiff: fp32-policy backward ops (bias-gradient ReduceSum) get f32 inputs, their
/// result cast back where a low-precision consumer needs it (passes/autocast.cpp).
std::unique_ptr<Pass> make_autocast_grad_pass();
/// Removes identity casts, duplicate casts of one value and f32->bf16->f32 round trips (passes/autocast.cpp).
std::unique_ptr<Pass> make_cast_simplify_pass();
/// --fp16 dynamic loss scaling, before autodiff: "loss_scale"/"growth_tracker" state and
/// "loss.scaled" = loss * loss_scale (passes/grad_scaler.cpp).
std::unique_ptr<Pass> make_loss_scale_pass();
/// After autodiff: every "<param>.grad" multiplied by 1/loss_scale (passes/grad_scaler.cpp).
std::unique_ptr<Pass> make_grad_unscale_pass();
/// After the optimizer: found_inf, skipped step (Where on state outputs), GradScaler
/// scale/growth update; outputs "found_inf", "loss_scale.next" (passes/grad_scaler.cpp).
std::unique_ptr<Pass> make_grad_scaler_update_pass();
/// Rematerialization (gradient checkpointing) after autodiff: RematOptions::policy
/// none|blocks|sqrt|min-cut|budget, memory_budget in bytes (passes/remat.cpp).
std::unique_ptr<Pass> make_remat_pass();
/// passes/fusion.cpp: groups pointwise nodes into FusedKernel nodes (compiled backend).
std::unique_ptr<Pass> make_fusion_pass();
/// bf16 / f16 MatMul/Gemm as f32 products of widened operands (LoweringOptions
/// widen_bf16_gemm, widen_f16_gemm; gemm_widening.cpp).
std::unique_ptr<Pass> make_gemm_widening_pass();
/// Pointwise FusedKernels write their output into a dying input (kiln_inplace; fused_inplace.cpp).
std::unique_ptr<Pass> make_fused_inplace_pass();
/// Consecutive independent generated kernels computing only step results (the optimizer's
/// updates) form one multi-tensor launch (kiln_multi_tensor_group; multi_tensor.cpp);
/// LoweringOptions::multi_tensor = false turns it off.
std::unique_ptr<Pass> make_multi_tensor_pass();
std::unique_ptr<Pass> make_arena_plan_pass();
/// Compiled pipeline, before fusion: LayerNormalizationGrad as a row op plus column sums (decompose.cpp).
std::unique_ptr<Pass> make_decompose_pass();
/// Common-subexpression elimination of generated-code nodes with small results (passes/cse.cpp).
std::unique_ptr<Pass> make_cse_pass();
/// Transposes feeding MatMul/Gemm operands read as strided operands (passes/absorb_transpose.cpp).
std::unique_ptr<Pass> make_absorb_transpose_pass();
/// Casts every float initializer, input and Cast target to f64 (passes/to_float64.cpp).
std::unique_ptr<Pass> make_to_float64_pass();

}  // namespace kiln::passes
