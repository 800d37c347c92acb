// SVG pictures of a run: training curves and memory profiles (see plot.h).
#include "tools/driver/plot.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <sstream>

#include "ir/graph.h"
#include "ir/op_table.h"

namespace kiln::driver {

namespace {

// Layout of one panel (px).
constexpr double kPanelW = 480, kPanelH = 300, kLeft = 70, kRight = 20, kTop = 40, kBottom = 45;
// Run colors (the Tableau 10 palette, matplotlib's default cycle).
const char* const kColors[] = {"#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
                               "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"};

std::string num(double v) {
  char b[32];
  std::snprintf(b, sizeof b, "%.2f", v);
  return b;
}

/// A tick label: 3 significant digits, exponent form for very small or large values.
std::string tick(double v) {
  char b[32];
  std::snprintf(b, sizeof b, "%.3g", v);
  return b;
}

/// XML text with &, <, >, " escaped.
std::string esc(const std::string& s) {
  std::string o;
  for (char c : s) {
    if (c == '&')
      o += "&amp;";
    else if (c == '<')
      o += "&lt;";
    else if (c == '>')
      o += "&gt;";
    else if (c == '"')
      o += "&quot;";
    else
      o += c;
  }
  return o;
}

/// An id-safe form of a label: letters, digits and '-' only.
std::string id_of(const std::string& s) {
  std::string o;
  for (char c : s) o += std::isalnum(static_cast<unsigned char>(c)) ? static_cast<char>(std::tolower(c)) : '-';
  return o;
}

std::string svg_open(double w, double h, const std::string& id, const std::string& title) {
  std::ostringstream os;
  os << "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
     << "<svg xmlns=\"http://www.w3.org/2000/svg\" version=\"1.1\" id=\"" << id << "\" width=\"" << num(w)
     << "\" height=\"" << num(h) << "\" viewBox=\"0 0 " << num(w) << " " << num(h)
     << "\" font-family=\"DejaVu Sans, Helvetica, Arial, sans-serif\" font-size=\"12\">\n"
     << "<title>" << esc(title) << "</title>\n"
     << "<rect x=\"0\" y=\"0\" width=\"" << num(w) << "\" height=\"" << num(h) << "\" fill=\"#ffffff\"/>\n";
  return os.str();
}

/// Axis frame, ticks and labels of a panel at (x0, y0) mapping [xmin, xmax] x [ymin, ymax].
struct Axes {
  double x0, y0, xmin, xmax, ymin, ymax;
  bool integer_x = true;  ///< x ticks rounded (steps); false: 3 significant digits
  double px(double x) const {
    return x0 + kLeft + (xmax > xmin ? (x - xmin) / (xmax - xmin) : 0.5) * (kPanelW - kLeft - kRight);
  }
  double py(double y) const {
    return y0 + kTop + (1 - (ymax > ymin ? (y - ymin) / (ymax - ymin) : 0.5)) * (kPanelH - kTop - kBottom);
  }
  std::string frame(const std::string& title, const std::string& xlabel,
                    const std::function<std::string(double)>& ylabel) const {
    std::ostringstream os;
    const double l = x0 + kLeft, r = x0 + kPanelW - kRight, t = y0 + kTop, b = y0 + kPanelH - kBottom;
    os << "<text class=\"title\" x=\"" << num((l + r) / 2) << "\" y=\"" << num(y0 + 22)
       << "\" text-anchor=\"middle\" font-size=\"14\" font-weight=\"bold\">" << esc(title) << "</text>\n";
    os << "<rect class=\"frame\" x=\"" << num(l) << "\" y=\"" << num(t) << "\" width=\"" << num(r - l) << "\" height=\""
       << num(b - t) << "\" fill=\"none\" stroke=\"#444444\"/>\n";
    for (int i = 0; i <= 4; ++i) {
      const double yv = ymin + (ymax - ymin) * i / 4.0, y = py(yv);
      os << "<line class=\"grid\" x1=\"" << num(l) << "\" y1=\"" << num(y) << "\" x2=\"" << num(r) << "\" y2=\""
         << num(y) << "\" stroke=\"#dddddd\"/>\n";
      os << "<text class=\"tick\" x=\"" << num(l - 5) << "\" y=\"" << num(y + 4) << "\" text-anchor=\"end\">"
         << esc(ylabel(yv)) << "</text>\n";
      const double xv = xmin + (xmax - xmin) * i / 4.0, x = px(xv);
      os << "<text class=\"tick\" x=\"" << num(x) << "\" y=\"" << num(b + 16) << "\" text-anchor=\"middle\">"
         << esc(tick(integer_x ? std::round(xv) : xv)) << "</text>\n";
    }
    os << "<text class=\"label\" x=\"" << num((l + r) / 2) << "\" y=\"" << num(b + 34) << "\" text-anchor=\"middle\">"
       << esc(xlabel) << "</text>\n";
    return os.str();
  }
};

}  // namespace

Expected<RunCurves> read_run_curves(const std::string& output_dir) {
  const std::string path = output_dir + "/metrics.jsonl";
  std::ifstream f(path);
  if (!f) return Status::error(path + ": no such file (is " + output_dir + " a kiln train --output_dir?)");
  RunCurves rc;
  rc.name = output_dir;
  std::string line;
  int n = 0;
  while (std::getline(f, line)) {
    ++n;
    if (line.empty()) continue;
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(line);
    } catch (const std::exception&) {
      // The last line of a run still writing may be cut (no newline yet): plot the rest.
      if (f.eof()) break;
      return Status::error(path + ":" + std::to_string(n) + ": not a JSON line");
    }
    if (!j.is_object() || !j.contains("step") || !j["step"].is_number()) continue;
    const double step = j["step"].get<double>();
    auto add = [&](const char* key, Series& s) {
      if (j.contains(key) && j[key].is_number()) s.points.emplace_back(step, j[key].get<double>());
    };
    add("loss", rc.loss);
    add("eval_loss", rc.eval_loss);
    add("learning_rate", rc.learning_rate);
    add("grad_norm", rc.grad_norm);
  }
  return rc;
}

std::string curves_svg(const std::vector<RunCurves>& runs) {
  struct Panel {
    const char* id;
    const char* title;
    Series RunCurves::*series;
  };
  const Panel panels[] = {{"loss", "training loss", &RunCurves::loss},
                          {"eval-loss", "eval loss", &RunCurves::eval_loss},
                          {"learning-rate", "learning rate", &RunCurves::learning_rate},
                          {"grad-norm", "grad norm", &RunCurves::grad_norm}};
  const double legend_h = 24.0 * static_cast<double>(runs.size()) + 16;
  const double W = 2 * kPanelW, H = 2 * kPanelH + legend_h;
  std::ostringstream os;
  os << svg_open(W, H, "kiln-curves", "kiln training curves");
  for (int p = 0; p < 4; ++p) {
    const Panel& pn = panels[p];
    double xmin = INFINITY, xmax = -INFINITY, ymin = INFINITY, ymax = -INFINITY;
    for (const RunCurves& r : runs)
      for (auto [x, y] : (r.*pn.series).points) {
        if (!std::isfinite(y)) continue;
        xmin = std::min(xmin, x), xmax = std::max(xmax, x), ymin = std::min(ymin, y), ymax = std::max(ymax, y);
      }
    if (!(xmin <= xmax)) {  // no run logged this series (no eval data, no clipping): say so, draw no axes
      os << "<g id=\"panel-" << pn.id << "\">\n<text class=\"not-logged\" x=\"" << num((p % 2) * kPanelW + kPanelW / 2)
         << "\" y=\"" << num((p / 2) * kPanelH + kPanelH / 2) << "\" text-anchor=\"middle\" font-size=\"14\">"
         << esc(pn.title) << ": not logged by these runs</text>\n</g>\n";
      continue;
    }
    if (ymin > 0 && ymin < 0.5 * ymax) ymin = 0;  // start at zero when that keeps the curve readable
    const double pad = (ymax - ymin) * 0.05;
    ymax += pad;
    if (ymin != 0) ymin -= pad;
    Axes ax{(p % 2) * kPanelW, (p / 2) * kPanelH, xmin, xmax, ymin, ymax};
    os << "<g id=\"panel-" << pn.id << "\">\n" << ax.frame(pn.title, "step", [](double v) { return tick(v); });
    for (size_t i = 0; i < runs.size(); ++i) {
      const Series& s = runs[i].*pn.series;
      std::ostringstream pts;
      size_t k = 0;
      for (auto [x, y] : s.points)
        if (std::isfinite(y)) pts << (k++ ? " " : "") << num(ax.px(x)) << "," << num(ax.py(y));
      if (k == 0) continue;
      const char* color = kColors[i % 10];
      os << "<polyline id=\"series-" << pn.id << "-" << i << "\" class=\"series\" fill=\"none\" stroke=\"" << color
         << "\" stroke-width=\"1.5\" points=\"" << pts.str() << "\"/>\n";
      if (k == 1)  // a single point (one evaluation) shows as a dot
        os << "<circle class=\"point\" cx=\"" << num(ax.px(s.points[0].first)) << "\" cy=\""
           << num(ax.py(s.points[0].second)) << "\" r=\"3\" fill=\"" << color << "\"/>\n";
    }
    os << "</g>\n";
  }
  os << "<g id=\"legend\">\n";
  for (size_t i = 0; i < runs.size(); ++i) {
    const double y = 2 * kPanelH + 16 + 24.0 * static_cast<double>(i);
    os << "<line class=\"swatch\" x1=\"" << num(kLeft) << "\" y1=\"" << num(y) << "\" x2=\"" << num(kLeft + 30)
       << "\" y2=\"" << num(y) << "\" stroke=\"" << kColors[i % 10] << "\" stroke-width=\"3\"/>\n";
    os << "<text id=\"legend-run-" << i << "\" x=\"" << num(kLeft + 40) << "\" y=\"" << num(y + 4) << "\">"
       << esc(runs[i].name) << "</text>\n";
  }
  os << "</g>\n</svg>\n";
  return os.str();
}

MemoryProfile memory_profile(const passes::MemoryPlan& plan, const std::string& label) {
  MemoryProfile mp;
  mp.label = label;
  mp.by_node = plan.live;
  if (mp.by_node.empty()) mp.by_node.push_back(passes::CategoryBytes{});  // a graph without nodes
  mp.peak_bytes = plan.peak_bytes;
  mp.peak_node = plan.peak_node;
  mp.backward_start = plan.backward_start;
  mp.optimizer_start = plan.optimizer_start;
  return mp;
}

std::string memory_svg(const std::vector<MemoryProfile>& profiles) {
  // Category colors, bottom to top in the stack.
  static const char* const kCatColors[passes::kNumMemoryCategories] = {"#1f77b4", "#aec7e8", "#ff7f0e", "#2ca02c",
                                                                       "#d62728", "#9467bd", "#8c564b"};
  int64_t ymax = 1;
  for (const MemoryProfile& p : profiles) {
    ymax = std::max(ymax, p.peak_bytes);
    for (const auto& b : p.by_node) {
      int64_t t = 0;
      for (int64_t v : b) t += v;
      ymax = std::max(ymax, t);
    }
  }
  const double W = kPanelW * static_cast<double>(std::max<size_t>(1, profiles.size()));
  int categories = 0;  // the legend's entries: categories with bytes in some panel
  for (int k = 0; k < passes::kNumMemoryCategories; ++k) {
    bool any = false;
    for (const MemoryProfile& p : profiles)
      for (const auto& b : p.by_node) any = any || b[k] > 0;
    categories += any;
  }
  // Legend columns of 200 px that fit the width (one panel holds two).
  const int per_row = std::max(1, std::min(3, static_cast<int>((W - kLeft) / 200.0)));
  const double legend_h = 24.0 * ((categories + per_row - 1) / per_row) + 16;
  const double H = kPanelH + legend_h;
  std::ostringstream os;
  os << svg_open(W, H, "kiln-memory", "kiln memory plan: live bytes over the training step");
  std::vector<bool> used(passes::kNumMemoryCategories, false);
  for (size_t pi = 0; pi < profiles.size(); ++pi) {
    const MemoryProfile& p = profiles[pi];
    const int N = static_cast<int>(p.by_node.size());
    const std::string pid = id_of(p.label);
    Axes ax{static_cast<double>(pi) * kPanelW,       0, 0,
            static_cast<double>(std::max(1, N - 1)), 0, static_cast<double>(ymax) * 1.08};
    os << "<g id=\"panel-" << pid << "\">\n"
       << ax.frame(p.label, "schedule position (node)",
                   [](double v) { return passes::human_bytes(static_cast<int64_t>(std::llround(v))); });
    // At most one column per pixel: each column shows its largest total (and that node's split).
    const int cols = std::max(1, std::min(N, static_cast<int>(kPanelW - kLeft - kRight)));
    std::vector<int> pick(static_cast<size_t>(cols));
    for (int c = 0; c < cols; ++c) {
      const int a = static_cast<int>(static_cast<int64_t>(c) * N / cols),
                b = std::max(a + 1, static_cast<int>(static_cast<int64_t>(c + 1) * N / cols));
      int best = a;
      int64_t best_t = -1;
      for (int i = a; i < b && i < N; ++i) {
        int64_t t = 0;
        for (int64_t v : p.by_node[static_cast<size_t>(i)]) t += v;
        if (t > best_t) best_t = t, best = i;
      }
      pick[static_cast<size_t>(c)] = best;
    }
    // Stacked areas: category k spans [sum of categories below, that + its bytes].
    std::vector<int64_t> base(static_cast<size_t>(cols), 0);
    for (int k = 0; k < passes::kNumMemoryCategories; ++k) {
      bool any = false;
      for (int c = 0; c < cols; ++c) any = any || p.by_node[static_cast<size_t>(pick[static_cast<size_t>(c)])][k] > 0;
      if (!any || N == 0) continue;
      used[static_cast<size_t>(k)] = true;
      std::ostringstream d;
      auto xat = [&](int c) {
        return cols == 1 ? ax.px(0) : ax.px(static_cast<double>(c) * (N - 1) / static_cast<double>(cols - 1));
      };
      for (int c = 0; c < cols; ++c) {
        const int64_t top =
            base[static_cast<size_t>(c)] + p.by_node[static_cast<size_t>(pick[static_cast<size_t>(c)])][k];
        d << (c ? " L" : "M") << num(xat(c)) << "," << num(ax.py(static_cast<double>(top)));
      }
      for (int c = cols - 1; c >= 0; --c)
        d << " L" << num(xat(c)) << "," << num(ax.py(static_cast<double>(base[static_cast<size_t>(c)])));
      d << " Z";
      for (int c = 0; c < cols; ++c)
        base[static_cast<size_t>(c)] += p.by_node[static_cast<size_t>(pick[static_cast<size_t>(c)])][k];
      const std::string cat = passes::memory_category_name(static_cast<passes::MemoryCategory>(k));
      os << "<path id=\"area-" << pid << "-" << id_of(cat) << "\" class=\"area\" fill=\"" << kCatColors[k]
         << "\" stroke=\"none\" d=\"" << d.str() << "\"><title>" << esc(cat) << "</title></path>\n";
    }
    const double top = ax.py(ax.ymax), bottom = ax.py(0);
    auto vline = [&](const std::string& id, const std::string& cls, int node, const char* color,
                     const std::string& text, const char* dash) {
      const double x = ax.px(node);
      os << "<line id=\"" << id << "\" class=\"" << cls << "\" x1=\"" << num(x) << "\" y1=\"" << num(top) << "\" x2=\""
         << num(x) << "\" y2=\"" << num(bottom) << "\" stroke=\"" << color << "\" stroke-dasharray=\"" << dash
         << "\"/>\n";
      os << "<text class=\"" << cls << "-label\" x=\"" << num(x + 3) << "\" y=\"" << num(bottom - 6) << "\" fill=\""
         << color << "\" stroke=\"#ffffff\" stroke-width=\"3\" paint-order=\"stroke\">" << esc(text) << "</text>\n";
    };
    if (p.backward_start >= 0)
      vline("phase-" + pid + "-backward", "phase", p.backward_start, "#555555", "backward", "4,3");
    if (p.optimizer_start >= 0)
      vline("phase-" + pid + "-optimizer", "phase", p.optimizer_start, "#555555", "optimizer", "4,3");
    if (p.peak_node >= 0) {
      const double x = ax.px(p.peak_node), y = ax.py(static_cast<double>(p.peak_bytes));
      os << "<circle id=\"peak-" << pid << "\" class=\"peak\" cx=\"" << num(x) << "\" cy=\"" << num(y)
         << "\" r=\"4\" fill=\"#000000\"/>\n";
      os << "<text class=\"peak-label\" x=\"" << num(x) << "\" y=\"" << num(y - 8)
         << "\" text-anchor=\"middle\" font-weight=\"bold\">peak " << esc(passes::human_bytes(p.peak_bytes))
         << "</text>\n";
    }
    os << "</g>\n";
  }
  os << "<g id=\"legend\">\n";
  int shown = 0;
  for (int k = 0; k < passes::kNumMemoryCategories; ++k) {
    if (!used[static_cast<size_t>(k)]) continue;
    const double x = kLeft + (shown % per_row) * 200.0, y = kPanelH + 10 + (shown / per_row) * 24.0;
    const std::string cat = passes::memory_category_name(static_cast<passes::MemoryCategory>(k));
    os << "<rect class=\"swatch\" x=\"" << num(x) << "\" y=\"" << num(y) << "\" width=\"14\" height=\"14\" fill=\""
       << kCatColors[k] << "\"/>\n";
    os << "<text id=\"legend-" << id_of(cat) << "\" x=\"" << num(x + 20) << "\" y=\"" << num(y + 11) << "\">"
       << esc(cat) << "</text>\n";
    ++shown;
  }
  os << "</g>\n</svg>\n";
  return os.str();
}

std::string scatter_svg(const std::string& title, const std::string& xlabel, const std::string& ylabel,
                        const std::vector<ScatterPoint>& points, double vline_x, const std::string& vline_label) {
  double xmin = INFINITY, xmax = -INFINITY, ymin = 0, ymax = -INFINITY;
  for (const auto& p : points) {
    if (!std::isfinite(p.x) || !std::isfinite(p.y)) continue;
    xmin = std::min(xmin, p.x), xmax = std::max(xmax, p.x), ymax = std::max(ymax, p.y);
  }
  // A line far past the points (a budget of all the machine's memory) would squeeze them
  // into a sliver: it is then written as a label at the right edge instead.
  const bool line_off = std::isfinite(vline_x) && xmax > -INFINITY && vline_x > 3 * xmax;
  if (std::isfinite(vline_x) && !line_off) xmin = std::min(xmin, vline_x), xmax = std::max(xmax, vline_x);
  if (!(xmin <= xmax)) xmin = 0, xmax = 1;
  if (!(ymax > ymin)) ymax = 1;
  if (xmax == xmin) xmin -= 0.5, xmax += 0.5;
  const double xpad = (xmax - xmin) * 0.05;
  xmin = std::max(0.0, xmin - xpad), xmax += xpad, ymax *= 1.08;
  const double W = kPanelW * 1.5, H = kPanelH * 1.5;
  std::ostringstream os;
  os << svg_open(W, H, "kiln-scatter", title);
  // The panel at 1.5x scale: an Axes of the standard size, drawn under a transform.
  Axes ax{0, 0, xmin, xmax, ymin, ymax, false};
  os << "<g id=\"panel-scatter\" transform=\"scale(1.5)\">\n"
     << ax.frame(title, xlabel, [](double v) { return tick(v); });
  const double ymid = kTop + (kPanelH - kTop - kBottom) / 2;
  os << "<text class=\"label\" x=\"14\" y=\"" << num(ymid) << "\" text-anchor=\"middle\" transform=\"rotate(-90 14 "
     << num(ymid) << ")\">" << esc(ylabel) << "</text>\n";
  if (line_off) {
    os << "<text id=\"vline\" class=\"budget-label\" x=\"" << num(kPanelW - kRight - 4) << "\" y=\"" << num(kTop + 12)
       << "\" text-anchor=\"end\" fill=\"#d62728\">" << esc(vline_label) << " (far right) &#8594;</text>\n";
  } else if (std::isfinite(vline_x)) {
    const double x = ax.px(vline_x);
    os << "<line id=\"vline\" class=\"budget\" x1=\"" << num(x) << "\" y1=\"" << num(kTop) << "\" x2=\"" << num(x)
       << "\" y2=\"" << num(kPanelH - kBottom)
       << "\" stroke=\"#d62728\" stroke-width=\"1.5\" stroke-dasharray=\"5,3\"/>\n";
    os << "<text class=\"budget-label\" x=\"" << num(x + 4) << "\" y=\"" << num(kTop + 12) << "\" fill=\"#d62728\">"
       << esc(vline_label) << "</text>\n";
  }
  for (size_t i = 0; i < points.size(); ++i) {
    const ScatterPoint& p = points[i];
    if (!std::isfinite(p.x) || !std::isfinite(p.y)) continue;
    const char* color = kColors[static_cast<size_t>(std::max(0, p.group)) % 10];
    os << "<circle id=\"point-" << i << "\" class=\"point\" cx=\"" << num(ax.px(p.x)) << "\" cy=\"" << num(ax.py(p.y))
       << "\" r=\"" << (p.highlight ? 6 : 3.5) << "\" fill=\"" << (p.filled ? color : "none") << "\" stroke=\"" << color
       << "\"" << (p.highlight ? " stroke-width=\"2.5\"" : "") << "><title>" << esc(p.label) << "</title></circle>\n";
    if (p.highlight)
      os << "<text class=\"point-label\" x=\"" << num(ax.px(p.x) + 8) << "\" y=\"" << num(ax.py(p.y) - 8)
         << "\" font-weight=\"bold\">" << esc(p.label) << "</text>\n";
  }
  os << "</g>\n</svg>\n";
  return os.str();
}

Status write_text_files(const std::vector<std::pair<std::string, std::string>>& files) {
  std::vector<std::string> tmps;
  auto cleanup = [&] {
    std::error_code ec;
    for (const auto& t : tmps) std::filesystem::remove(t, ec);
  };
  for (const auto& [path, text] : files) {
    const std::string tmp = path + ".tmp." + std::to_string(::getpid());
    tmps.push_back(tmp);
    if (Status st = write_text_file(tmp, text); !st) {
      cleanup();
      return Status::error(path + ": cannot write");
    }
  }
  for (size_t i = 0; i < files.size(); ++i) {
    std::error_code ec;
    std::filesystem::rename(tmps[i], files[i].first, ec);
    if (ec) {
      cleanup();
      return Status::error(files[i].first + ": cannot write (" + ec.message() + ")");
    }
  }
  return Status::ok();
}

Status write_text_file(const std::string& path, const std::string& text) {
  std::ofstream f(path, std::ios::out | std::ios::trunc);
  if (!f) return Status::error(path + ": cannot open for writing");
  f << text;
  f.flush();
  if (!f) return Status::error(path + ": write failed");
  return Status::ok();
}

}  // namespace kiln::driver
