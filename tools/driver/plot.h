// SVG pictures of a run (issue 34), written by hand (no plotting dependency): standalone
// SVG 1.1 documents that browsers open and xmllint validates.
//   - training curves from metrics.jsonl (`kiln plot OUTPUT_DIR... -o curves.svg`):
//     training loss, eval loss, learning rate and grad norm, several runs overlaid;
//   - the live bytes of a training step's memory plan over its schedule, stacked by
//     category, the peak and the forward/backward/optimizer phases marked
//     (`kiln inspect MODEL --memory --plot memory.svg`), one panel per remat policy.
// Elements carry ids (panel-*, series-*, area-*, peak-*, phase-*) that tests count.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "ir/status.h"
#include "passes/memory_plan.h"

namespace kiln::driver {

/// One metric of one run: (step, value) points in step order.
struct Series {
  std::vector<std::pair<double, double>> points;
};

/// The curves of one run, read from its metrics.jsonl.
struct RunCurves {
  std::string name;  ///< the legend's label (the output folder)
  Series loss, eval_loss, learning_rate, grad_norm;
};

/// Reads DIR/metrics.jsonl (lines with "loss", "eval_loss", "learning_rate",
/// "grad_norm"; null values skipped). Error: no such file, or a line that is not JSON.
Expected<RunCurves> read_run_curves(const std::string& output_dir);

/// A 2x2 grid of panels (train loss, eval loss, learning rate, grad norm), one colored
/// polyline per run and panel, a legend naming the runs.
std::string curves_svg(const std::vector<RunCurves>& runs);

/// Live bytes per schedule position of one plan, by category.
struct MemoryProfile {
  std::string label;                           ///< the panel's title ("remat none")
  std::vector<passes::CategoryBytes> by_node;  ///< per node of the schedule
  int64_t peak_bytes = 0;
  int peak_node = -1;
  int backward_start = -1, optimizer_start = -1;  ///< the phases' first nodes (-1: none)
};

/// The profile of `plan`: its live bytes per schedule position and category and its phase
/// boundaries, exactly as the planner accounts them (passes::MemoryPlan::live).
MemoryProfile memory_profile(const passes::MemoryPlan& plan, const std::string& label);

/// Stacked areas (one per category that holds bytes) of each profile side by side, peak
/// lines, phase lines, a legend of the categories.
std::string memory_svg(const std::vector<MemoryProfile>& profiles);

/// One point of a scatter plot.
struct ScatterPoint {
  std::string label;  ///< the point's tooltip (and its text when highlighted)
  double x = 0, y = 0;
  int group = 0;           ///< color index (Tableau 10 cycle)
  bool filled = true;      ///< filled disc (else a ring)
  bool highlight = false;  ///< drawn larger, its label written beside it
};

/// One panel of `points` (y from 0), a dashed vertical line at `vline_x` labelled
/// `vline_label` (none when vline_x is not finite). Elements: panel-scatter, point-N, vline.
std::string scatter_svg(const std::string& title, const std::string& xlabel, const std::string& ylabel,
                        const std::vector<ScatterPoint>& points, double vline_x, const std::string& vline_label);

/// Writes each (path, text) pair, all or none: each to a temporary file beside it, then
/// renamed into place once all are written; on an error the temporaries are removed and
/// no file is touched. Error: the first path that cannot be written.
Status write_text_files(const std::vector<std::pair<std::string, std::string>>& files);

/// Writes `text` to `path`. Error: cannot write.
Status write_text_file(const std::string& path, const std::string& text);

}  // namespace kiln::driver
