// Factories of every pass (one line each; see passes/registry.cpp).
#pragma once
#include <memory>

#include "passes/pass.h"

namespace kiln::passes {

/// Re-runs type inference, removes Identity nodes and dead code.
std::unique_ptr<Pass> make_canonicalize_pass();

}  // namespace kiln::passes
