#include "coordinator/planner/route_builder.h"

#include <algorithm>
#include <limits>

namespace detour::planner {

QuotaPacer::QuotaPacer(const sim::CostModel& cost, const sim::StageAssignment& assignment,
                       const RouteRules& rules, std::vector<int> quota, int routes)
    : num_stages_(rules.num_stages), quota_(std::move(quota)), left_(routes) {
  const int visits = rules.visited_stages - 1;
  fraction_ = num_stages_ > 1 ? static_cast<double>(visits) / (num_stages_ - 1) : 0;
  slack_ = 2.0 + 0.05 * routes * fraction_;
  const auto& data = assignment.stage_nodes[0];
  int terms = 0;
  for (int s = 1; s < num_stages_ && !data.empty(); ++s) {
    for (int n : assignment.stage_nodes[s]) {
      const int d = data[(s + n) % data.size()];
      unit_ += cost.ForwardTime(n, s) + cost.BackwardTime(n, s) + cost.TransferTime(d, n) +
               cost.TransferTime(n, d);
      ++terms;
    }
  }
  if (terms > 0) unit_ /= terms;
}

void QuotaPacer::Prepare(RouteRequest& req) const {
  req.allowed.assign(num_stages_, 0);
  req.required.assign(num_stages_, 0);
  req.stage_price.assign(num_stages_, 0);
  const double share = left_ * fraction_;
  const double tolerance = std::max(0.5, std::min(slack_, 0.25 * share));
  for (int s = 1; s < num_stages_; ++s) {
    req.allowed[s] = quota_[s] > 0;
    req.required[s] = quota_[s] >= left_;
    req.stage_price[s] = -unit_ * (quota_[s] - share) / tolerance;
  }
}

bool QuotaPacer::Fits(const std::vector<int>& stages) const {
  std::vector<char> in(num_stages_, 0);
  for (size_t i = 1; i < stages.size(); ++i) {
    if (quota_[stages[i]] <= 0) return false;
    in[stages[i]] = 1;
  }
  for (int s = 1; s < num_stages_; ++s) {
    if (quota_[s] >= left_ && !in[s]) return false;
  }
  return true;
}

void QuotaPacer::Take(const std::vector<int>& stages) {
  for (size_t i = 1; i < stages.size(); ++i) --quota_[stages[i]];
  --left_;
}

double Calendar::EarliestFit(double t, double duration) const {
  // First busy interval ending after t.
  auto it =
      std::upper_bound(busy_.begin(), busy_.end(), t,
                       [](double v, const std::pair<double, double>& b) { return v < b.second; });
  double start = t;
  for (; it != busy_.end(); ++it) {
    if (it->first >= start + duration) break;
    start = std::max(start, it->second);
  }
  return start;
}

void Calendar::Reserve(double start, double duration) {
  if (duration <= 0) return;
  busy_s_ += duration;
  auto it = std::lower_bound(busy_.begin(), busy_.end(), std::make_pair(start, start + duration));
  busy_.insert(it, {start, start + duration});
}

RouteBuilder::RouteBuilder(const sim::CostModel& cost, const sim::StageAssignment& assignment,
                           const RouteRules& rules, Mode mode, uint64_t seed, int max_candidates)
    : cost_(cost),
      assignment_(assignment),
      rules_(rules),
      mode_(mode),
      rng_(seed),
      max_candidates_(max_candidates),
      calendars_(cost.num_nodes()) {}

void RouteBuilder::Candidates(int stage, const RouteRequest& request, std::vector<int>& nodes) {
  for (int n : assignment_.stage_nodes[stage]) {
    if (request.node_allowed.empty() || request.node_allowed[n]) nodes.push_back(n);
  }
  if (max_candidates_ <= 0 || static_cast<int>(nodes.size()) <= max_candidates_) return;
  const int d = request.data_node;
  std::vector<std::pair<double, int>> keyed;
  keyed.reserve(nodes.size());
  for (int n : nodes) {
    double key = 0;
    switch (mode_) {
      case Mode::kStatic:
        key = cost_.TransferTime(d, n) + cost_.TransferTime(n, d) + cost_.ForwardTime(n, stage) +
              cost_.BackwardTime(n, stage);
        break;
      case Mode::kTimed:
        key = calendars_[n].busy_s() + cost_.TransferTime(d, n) + cost_.ForwardTime(n, stage);
        break;
      case Mode::kRandom: key = rng_.UniformReal(); break;
    }
    keyed.push_back({key, n});
  }
  std::partial_sort(keyed.begin(), keyed.begin() + max_candidates_, keyed.end());
  nodes.clear();
  for (int i = 0; i < max_candidates_; ++i) nodes.push_back(keyed[i].second);
}

namespace {

// Places a whole route into the calendars (forward, loss, backward in the
// reverse order) and returns its end and the reservations it would make.
double TimedSchedule(const sim::CostModel& cost, const std::vector<Calendar>& cal,
                     const std::vector<int>& nodes, const std::vector<int>& stages, double release,
                     std::vector<std::pair<int, std::pair<double, double>>>* reservations) {
  const int d = nodes[0];
  const int len = static_cast<int>(nodes.size());
  double t = release;
  for (int i = 0; i < len; ++i) {
    const int n = nodes[i];
    if (i > 0) t += cost.TransferTime(nodes[i - 1], n);
    const double f = cost.ForwardTime(n, stages[i]);
    const double start = cal[n].EarliestFit(t, f);
    if (reservations) reservations->push_back({n, {start, f}});
    t = start + f;
  }
  if (len > 1) t += cost.TransferTime(nodes[len - 1], d);
  const double l = cost.LossTime(d);
  double start = cal[d].EarliestFit(t, l);
  if (reservations) reservations->push_back({d, {start, l}});
  t = start + l;
  for (int i = len - 1; i >= 0; --i) {
    const int n = nodes[i];
    const int prev = i == len - 1 ? d : nodes[i + 1];
    if (len > 1) t += cost.TransferTime(prev, n);
    const double b = cost.BackwardTime(n, stages[i]);
    start = cal[n].EarliestFit(t, b);
    if (reservations) reservations->push_back({n, {start, b}});
    t = start + b;
  }
  return t;
}

}  // namespace

std::optional<BuiltRoute> RouteBuilder::Build(const RouteRequest& req) {
  const int num_stages = rules_.num_stages;
  const int need = rules_.visited_stages - 1;
  const int d = req.data_node;
  BuiltRoute best;
  if (need == 0) {
    best.nodes = {d};
    best.stages = {0};
    if (mode_ == Mode::kTimed) {
      best.score = TimedSchedule(cost_, calendars_, best.nodes, best.stages, req.release_s,
                                 &best.reservations);
    }
    return best;
  }

  std::vector<std::vector<int>>& cand = cand_;
  cand.resize(num_stages);
  cand[0].assign(1, d);
  for (int s = 1; s < num_stages; ++s) {
    cand[s].clear();
    if (req.allowed[s]) Candidates(s, req, cand[s]);
  }
  std::vector<int>& next_required = next_required_;
  next_required.assign(num_stages, num_stages);
  for (int s = num_stages - 2; s >= 0; --s) {
    next_required[s] = req.required[s + 1] ? s + 1 : next_required[s + 1];
  }
  // State (s, j, c): at the j-th candidate of stage s after c visits.
  const int width = need + 1;
  std::vector<int>& offset = offset_;
  offset.assign(num_stages + 1, 0);
  for (int s = 0; s < num_stages; ++s) {
    offset[s + 1] = offset[s] + static_cast<int>(cand[s].size()) * width;
  }
  // value: the ordering key (kTimed: forward finish + prices); finish: the
  // forward finish time itself (kTimed only).
  std::vector<double>& value = value_;
  std::vector<double>& finish = finish_;
  std::vector<int>& parent = parent_;
  value.assign(offset[num_stages], kInf);
  finish.assign(offset[num_stages], 0);
  parent.assign(offset[num_stages], -1);
  auto price = [&](int stage) { return req.stage_price.empty() ? 0.0 : req.stage_price[stage]; };
  auto node_of = [&](int idx, int* stage) {
    const int s =
        static_cast<int>(std::upper_bound(offset.begin(), offset.end(), idx) - offset.begin()) - 1;
    *stage = s;
    return cand[s][(idx - offset[s]) / width];
  };
  if (mode_ == Mode::kTimed) {
    const double f0 = cost_.ForwardTime(d, 0);
    finish[0] = calendars_[d].EarliestFit(req.release_s, f0) + f0;
    value[0] = finish[0];
  } else {
    value[0] = 0;
  }

  for (int s = 0; s < num_stages; ++s) {
    for (int j = 0; j < static_cast<int>(cand[s].size()); ++j) {
      const int a = cand[s][j];
      for (int c = 0; c < need; ++c) {
        const int idx = offset[s] + j * width + c;
        const double v = value[idx];
        if (v == kInf) continue;
        const int last = std::min(num_stages - 1, s + rules_.max_jump);
        for (int s2 = s + 1; s2 <= last && s2 <= next_required[s]; ++s2) {
          for (int j2 = 0; j2 < static_cast<int>(cand[s2].size()); ++j2) {
            const int b = cand[s2][j2];
            double nv = v + price(s2);
            double nf = 0;
            switch (mode_) {
              case Mode::kStatic:
                nv += cost_.TransferTime(a, b) + cost_.TransferTime(b, a) +
                      cost_.ForwardTime(b, s2) + cost_.BackwardTime(b, s2) +
                      (req.node_price.empty() ? 0.0 : req.node_price[b]);
                break;
              case Mode::kTimed: {
                const double f = cost_.ForwardTime(b, s2);
                nf = calendars_[b].EarliestFit(finish[idx] + cost_.TransferTime(a, b), f) + f;
                nv += nf - finish[idx];
                break;
              }
              case Mode::kRandom: nv += rng_.UniformReal(); break;
            }
            const int idx2 = offset[s2] + j2 * width + c + 1;
            if (nv < value[idx2]) {
              value[idx2] = nv;
              finish[idx2] = nf;
              parent[idx2] = idx;
            }
          }
        }
      }
    }
  }

  double best_score = kInf;
  for (int s = 1; s < num_stages; ++s) {
    if (next_required[s] != num_stages) continue;
    for (int j = 0; j < static_cast<int>(cand[s].size()); ++j) {
      const int idx = offset[s] + j * width + need;
      if (value[idx] == kInf) continue;
      std::vector<int> nodes, stages;
      for (int i = idx; i >= 0; i = parent[i]) {
        int st = 0;
        nodes.push_back(node_of(i, &st));
        stages.push_back(st);
      }
      std::reverse(nodes.begin(), nodes.end());
      std::reverse(stages.begin(), stages.end());
      const int n = cand[s][j];
      double score = 0;
      switch (mode_) {
        case Mode::kStatic:
          score = value[idx] + cost_.TransferTime(n, d) + cost_.TransferTime(d, n);
          break;
        case Mode::kTimed:
          // The end of the backward plus the prices collected on the way.
          score = TimedSchedule(cost_, calendars_, nodes, stages, req.release_s, nullptr) +
                  value[idx] - finish[idx];
          break;
        case Mode::kRandom: score = value[idx] + rng_.UniformReal(); break;
      }
      if (score < best_score) {
        best_score = score;
        best.nodes = std::move(nodes);
        best.stages = std::move(stages);
      }
    }
  }
  if (best_score == kInf) return std::nullopt;
  best.score = best_score;
  if (mode_ == Mode::kTimed) {
    TimedSchedule(cost_, calendars_, best.nodes, best.stages, req.release_s, &best.reservations);
  }
  return best;
}

void RouteBuilder::Commit(const BuiltRoute& route) {
  for (const auto& [node, interval] : route.reservations) {
    calendars_[node].Reserve(interval.first, interval.second);
  }
}

}  // namespace detour::planner
