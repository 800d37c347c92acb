// Padded lengths per --shape_mode (see shapes.h).
#include "runtime/shapes.h"

#include <algorithm>
#include <utility>

namespace kiln::runtime {

bool symbolic_rows(const ir::Graph& g, const std::vector<std::string>& data_inputs) {
  for (const ir::Value* in : g.inputs)
    if (in->shape.rank() > 0 && in->shape.dims[0].is_symbolic() &&
        std::find(data_inputs.begin(), data_inputs.end(), in->name) != data_inputs.end())
      return true;
  return false;
}

Expected<ShapeMode> parse_shape_mode(const std::string& text) {
  if (text == "pad") return ShapeMode::pad;
  if (text == "specialize") return ShapeMode::specialize;
  if (text == "buckets") return ShapeMode::buckets;
  if (text == "symbolic") return ShapeMode::symbolic;
  return Status::error("--shape_mode '" + text + "': expected pad, specialize, buckets or symbolic");
}

const char* shape_mode_name(ShapeMode m) {
  switch (m) {
    case ShapeMode::pad:
      return "pad";
    case ShapeMode::specialize:
      return "specialize";
    case ShapeMode::buckets:
      return "buckets";
    case ShapeMode::symbolic:
      return "symbolic";
  }
  return "?";
}

ShapeChooser::ShapeChooser(ShapeMode mode, int64_t max_length, std::vector<int64_t> buckets, int64_t recompile_limit)
    : mode_(mode),
      max_length_(max_length),
      buckets_(std::move(buckets)),
      limit_(std::max<int64_t>(1, recompile_limit)) {}

ShapeChoice ShapeChooser::choose(int64_t need) const {
  ShapeChoice c;
  need = std::clamp<int64_t>(need, 1, max_length_);
  switch (mode_) {
    case ShapeMode::pad:
      c.length = max_length_;
      break;
    case ShapeMode::buckets: {
      auto it = std::lower_bound(buckets_.begin(), buckets_.end(), need);
      c.length = it == buckets_.end() ? max_length_ : *it;
      break;
    }
    case ShapeMode::symbolic:
      c.length = need;
      break;
    case ShapeMode::specialize: {
      if (built_.count(need) || static_cast<int64_t>(built_.size()) < limit_) {
        c.length = need;
        break;
      }
      // Past the limit: the nearest built length that holds the batch, else the longest
      // (its program is the one built past the limit).
      auto it = built_.lower_bound(need);
      c.length = it == built_.end() ? max_length_ : *it;
      c.limited = true;
      break;
    }
  }
  c.new_program = mode_ == ShapeMode::symbolic ? built_.empty() : !built_.count(c.length);
  return c;
}

}  // namespace kiln::runtime
