#include "common/sim/timeline_export.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/sim/json_writer.h"

namespace detour::sim {
namespace {

std::string XmlEscape(absl::string_view text) {
  std::string out;
  for (char c : text) {
    switch (c) {
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '&': out += "&amp;"; break;
      case '"': out += "&quot;"; break;
      default: out += c;
    }
  }
  return out;
}

// Assigned nodes ordered by stage, then by position within the stage.
std::vector<int> RowOrder(const Plan& plan) {
  std::vector<int> rows;
  for (const auto& nodes : plan.assignment.stage_nodes) {
    rows.insert(rows.end(), nodes.begin(), nodes.end());
  }
  return rows;
}

const char* Colour(ActivityKind kind) {
  switch (kind) {
    case ActivityKind::kForward: return "#4e79a7";
    case ActivityKind::kBackward: return "#f28e2b";
    case ActivityKind::kLoss: return "#e15759";
    case ActivityKind::kSendActivation: return "#59a14f";
    case ActivityKind::kSendGradient: return "#8cd17d";
    case ActivityKind::kAllReduce: return "#b07aa1";
  }
  return "#000000";
}

const char* Label(ActivityKind kind) {
  switch (kind) {
    case ActivityKind::kForward: return "forward";
    case ActivityKind::kBackward: return "backward";
    case ActivityKind::kLoss: return "loss + head";
    case ActivityKind::kSendActivation: return "send activation";
    case ActivityKind::kSendGradient: return "send gradient";
    case ActivityKind::kAllReduce: return "all-reduce";
  }
  return "?";
}

void TraceEvent(JsonWriter& w, const CostModel& cost, const Activity& a, int tid) {
  w.BeginObject();
  std::string name = ActivityKindName(a.kind);
  if (a.microbatch >= 0) absl::StrAppend(&name, " mb", a.microbatch);
  if (a.peer >= 0) absl::StrAppend(&name, " -> ", cost.node_id(a.peer));
  w.Key("name");
  w.String(name);
  w.Key("cat");
  w.String(ActivityKindName(a.kind));
  w.Key("ph");
  w.String("X");
  w.Key("ts");
  w.Number(a.start_s * 1e6);
  w.Key("dur");
  w.Number((a.end_s - a.start_s) * 1e6);
  w.Key("pid");
  w.Int(0);
  w.Key("tid");
  w.Int(tid);
  w.Key("args");
  w.BeginObject();
  w.Key("stage");
  w.Int(a.stage);
  if (a.microbatch >= 0) {
    w.Key("microbatch");
    w.Int(a.microbatch);
  }
  w.EndObject();
  w.EndObject();
}

void ThreadName(JsonWriter& w, int tid, const std::string& name) {
  w.BeginObject();
  w.Key("name");
  w.String("thread_name");
  w.Key("ph");
  w.String("M");
  w.Key("pid");
  w.Int(0);
  w.Key("tid");
  w.Int(tid);
  w.Key("args");
  w.BeginObject();
  w.Key("name");
  w.String(name);
  w.EndObject();
  w.EndObject();
  w.BeginObject();
  w.Key("name");
  w.String("thread_sort_index");
  w.Key("ph");
  w.String("M");
  w.Key("pid");
  w.Int(0);
  w.Key("tid");
  w.Int(tid);
  w.Key("args");
  w.BeginObject();
  w.Key("sort_index");
  w.Int(tid);
  w.EndObject();
  w.EndObject();
}

}  // namespace

std::string ChromeTraceJson(const CostModel& cost, const Plan& plan, const SimResult& result,
                            absl::string_view title) {
  JsonWriter w(0);
  w.BeginObject();
  w.Key("displayTimeUnit");
  w.String("ms");
  w.Key("otherData");
  w.BeginObject();
  w.Key("title");
  w.String(title);
  w.Key("iteration_time_s");
  w.Number(result.iteration_time_s);
  w.Key("pipeline_time_s");
  w.Number(result.pipeline_time_s);
  w.EndObject();
  w.Key("traceEvents");
  w.BeginArray();
  w.BeginObject();
  w.Key("name");
  w.String("process_name");
  w.Key("ph");
  w.String("M");
  w.Key("pid");
  w.Int(0);
  w.Key("args");
  w.BeginObject();
  w.Key("name");
  w.String(title);
  w.EndObject();
  w.EndObject();
  const std::vector<int> rows = RowOrder(plan);
  const std::vector<int> stage = plan.assignment.NodeStages(cost.num_nodes());
  for (size_t i = 0; i < rows.size(); ++i) {
    const int node = rows[i];
    const int compute_tid = static_cast<int>(2 * i);
    const int send_tid = compute_tid + 1;
    ThreadName(w, compute_tid, absl::StrCat(cost.node_id(node), " · stage ", stage[node]));
    ThreadName(w, send_tid, absl::StrCat(cost.node_id(node), " · uplink"));
    if (node < static_cast<int>(result.compute.size())) {
      for (const Activity& a : result.compute[node]) TraceEvent(w, cost, a, compute_tid);
    }
    if (node < static_cast<int>(result.sends.size())) {
      for (const Activity& a : result.sends[node]) TraceEvent(w, cost, a, send_tid);
    }
  }
  w.EndArray();
  w.EndObject();
  return w.str();
}

std::string TimelineSvg(const CostModel& cost, const Plan& plan, const SimResult& result,
                        const SvgOptions& options) {
  const std::vector<int> rows = RowOrder(plan);
  const std::vector<int> stage = plan.assignment.NodeStages(cost.num_nodes());
  const double max_t =
      options.max_time_s > 0 ? options.max_time_s : std::max(result.iteration_time_s, 1e-9);
  const int left = 130, right = 20, top = 56, row_h = 24, bar_h = 14;
  const int width = std::max(options.width_px, left + right + 200);
  const double plot_w = width - left - right;
  const int legend_y = top + static_cast<int>(rows.size()) * row_h + 40;
  const int height = legend_y + 40;
  auto x = [&](double t) { return left + plot_w * std::min(t, max_t) / max_t; };

  std::string svg = absl::StrFormat(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%d\" height=\"%d\" "
      "font-family=\"sans-serif\" font-size=\"12\">\n"
      "<rect width=\"100%%\" height=\"100%%\" fill=\"white\"/>\n",
      width, height);
  std::string heading = options.title.empty() ? "iteration timeline" : options.title;
  absl::StrAppendFormat(&svg,
                        "<text x=\"%d\" y=\"20\" font-size=\"15\" font-weight=\"bold\">%s</text>\n",
                        left, XmlEscape(heading));
  absl::StrAppendFormat(
      &svg,
      "<text x=\"%d\" y=\"38\">pipeline %.2f s, iteration (with all-reduce) %.2f s, "
      "compute utilisation %.0f%% of pipeline time</text>\n",
      left, result.pipeline_time_s, result.iteration_time_s, 100 * result.pipeline_utilization);

  // Time axis with about ten round ticks.
  const double raw_step = max_t / 10;
  const double mag = std::pow(10.0, std::floor(std::log10(raw_step)));
  double step = mag;
  for (double m : {1.0, 2.0, 5.0, 10.0}) {
    if (m * mag >= raw_step) {
      step = m * mag;
      break;
    }
  }
  const int axis_y = top + static_cast<int>(rows.size()) * row_h + 4;
  for (double t = 0; t <= max_t + 1e-9; t += step) {
    absl::StrAppendFormat(&svg,
                          "<line x1=\"%.1f\" y1=\"%d\" x2=\"%.1f\" y2=\"%d\" stroke=\"#dddddd\"/>\n"
                          "<text x=\"%.1f\" y=\"%d\" text-anchor=\"middle\">%g s</text>\n",
                          x(t), top - 4, x(t), axis_y, x(t), axis_y + 14, t);
  }

  for (size_t i = 0; i < rows.size(); ++i) {
    const int node = rows[i];
    const int y = top + static_cast<int>(i) * row_h;
    absl::StrAppendFormat(&svg,
                          "<text x=\"%d\" y=\"%d\" text-anchor=\"end\">%s · stage %d</text>\n",
                          left - 8, y + bar_h - 2, XmlEscape(cost.node_id(node)), stage[node]);
    // Idle first (background of the pipeline phase), then work on top.
    if (node < static_cast<int>(result.idle.size())) {
      for (const auto& gap : result.idle[node]) {
        absl::StrAppendFormat(&svg,
                              "<rect x=\"%.2f\" y=\"%d\" width=\"%.2f\" height=\"%d\" "
                              "fill=\"#e6e6e6\"/>\n",
                              x(gap.first), y, x(gap.second) - x(gap.first), bar_h);
      }
    }
    auto draw = [&](const Activity& a, int y0, int h) {
      std::string what = Label(a.kind);
      if (a.microbatch >= 0) absl::StrAppend(&what, " mb ", a.microbatch);
      if (a.peer >= 0) absl::StrAppend(&what, " to ", cost.node_id(a.peer));
      absl::StrAppendFormat(&svg,
                            "<rect x=\"%.2f\" y=\"%d\" width=\"%.2f\" height=\"%d\" fill=\"%s\" "
                            "stroke=\"white\" stroke-width=\"0.3\"><title>%s: %.3f-%.3f s</title>"
                            "</rect>\n",
                            x(a.start_s), y0, std::max(0.5, x(a.end_s) - x(a.start_s)), h,
                            Colour(a.kind), XmlEscape(what), a.start_s, a.end_s);
    };
    if (node < static_cast<int>(result.compute.size())) {
      for (const Activity& a : result.compute[node]) draw(a, y, bar_h);
    }
    if (node < static_cast<int>(result.sends.size())) {
      for (const Activity& a : result.sends[node]) draw(a, y + bar_h + 1, row_h - bar_h - 3);
    }
    for (const SvgOverlay& o : options.overlays) {
      if (o.node != node) continue;
      absl::StrAppendFormat(&svg,
                            "<rect x=\"%.2f\" y=\"%d\" width=\"%.2f\" height=\"%d\" "
                            "fill=\"%s\" stroke=\"white\" stroke-width=\"0.3\"><title>%s: "
                            "%.3f-%.3f s</title></rect>\n",
                            x(o.start_s), y, std::max(0.5, x(o.end_s) - x(o.start_s)), bar_h,
                            XmlEscape(o.colour), XmlEscape(o.label), o.start_s, o.end_s);
    }
  }

  // Legend.
  int lx = left;
  auto legend = [&](const char* colour, const char* text) {
    absl::StrAppendFormat(&svg,
                          "<rect x=\"%d\" y=\"%d\" width=\"14\" height=\"14\" fill=\"%s\" "
                          "stroke=\"#999999\" stroke-width=\"0.5\"/>"
                          "<text x=\"%d\" y=\"%d\">%s</text>\n",
                          lx, legend_y, colour, lx + 18, legend_y + 12, text);
    lx += 40 + 7 * static_cast<int>(std::string(text).size());
  };
  for (ActivityKind k :
       {ActivityKind::kForward, ActivityKind::kBackward, ActivityKind::kLoss,
        ActivityKind::kSendActivation, ActivityKind::kSendGradient, ActivityKind::kAllReduce}) {
    legend(Colour(k), Label(k));
  }
  legend("#e6e6e6", "idle (bubble)");
  for (const auto& [colour, text] : options.overlay_legend) legend(colour.c_str(), text.c_str());
  absl::StrAppendFormat(&svg,
                        "<text x=\"%d\" y=\"%d\" fill=\"#555555\">thick bar: compute; thin bar "
                        "below: the node's uplink (transfers)</text>\n",
                        left, legend_y + 32);
  svg += "</svg>\n";
  return svg;
}

}  // namespace detour::sim
