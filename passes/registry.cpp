// Name -> pass factory. Every pass is listed here once.
#include <functional>
#include <map>

#include "passes/pass.h"
#include "passes/passes.h"

namespace kiln::passes {

static const std::map<std::string, std::function<std::unique_ptr<Pass>()>>& factories() {
  static const std::map<std::string, std::function<std::unique_ptr<Pass>()>> f = {
      {"canonicalize", make_canonicalize_pass},
      {"fold_constants", make_fold_constants_pass},
      {"attach_loss", make_attach_loss_pass},
      {"autodiff", make_autodiff_pass},
      {"optimizer", make_optimizer_pass},
      {"accumulation", make_accumulation_pass},
      {"data_parallel", make_data_parallel_pass},
      {"to_float64", make_to_float64_pass},
      {"remat", make_remat_pass},
      {"fusion", make_fusion_pass},
      {"gemm_widening", make_gemm_widening_pass},
      {"fused_inplace", make_fused_inplace_pass},
      {"multi_tensor", make_multi_tensor_pass},
      {"arena_plan", make_arena_plan_pass},
      {"decompose", make_decompose_pass},
      {"cse", make_cse_pass},
      {"absorb_transpose", make_absorb_transpose_pass},
      {"eval_mode", make_eval_mode_pass},
      {"autocast", make_autocast_pass},
      {"cast_simplify", make_cast_simplify_pass},
      {"autocast_grad", make_autocast_grad_pass},
      {"loss_scale", make_loss_scale_pass},
      {"grad_unscale", make_grad_unscale_pass},
      {"grad_scaler_update", make_grad_scaler_update_pass},
  };
  return f;
}

std::unique_ptr<Pass> make_pass(const std::string& name) {
  auto it = factories().find(name);
  return it == factories().end() ? nullptr : it->second();
}

std::vector<std::string> pass_names() {
  std::vector<std::string> v;
  for (auto& [k, _] : factories()) v.push_back(k);
  return v;
}

}  // namespace kiln::passes
