// BubblePlanner::PlanIteration's pass, phase by phase (bubble_state.h).
#include <algorithm>
#include <cmath>
#include <limits>
#include <map>

#include "coordinator/planner/bubble_state.h"

namespace detour::planner {
namespace {

// A time that never comes: a gate not yet open, a layer not yet inverted.
constexpr double kNever = std::numeric_limits<double>::infinity();
constexpr double kEps = kBubbleEps;

}  // namespace

BubblePlanner::IterationPass::IterationPass(State& state, uint64_t iteration_in,
                                            const sim::Plan& plan_in,
                                            const IterationTimeline& timeline_in,
                                            bool close_window_in)
    : st(state),
      iteration(iteration_in),
      plan(plan_in),
      timeline(timeline_in),
      close_window(close_window_in),
      num_nodes(static_cast<int>(state.workload.nodes.size())),
      end(timeline_in.end_s),
      slack(1.0 + state.kfac.slack()),
      use_bubbles(state.kfac.placement() != v1::KFAC_PLACEMENT_SERIAL),
      fixed(state.kfac.refresh_interval()) {
  out.bubble_s.assign(num_nodes, 0);
  out.serial_s.assign(num_nodes, 0);
  out.precondition_s.assign(num_nodes, 0);
  serial_cursor.assign(num_nodes, 0);
  serial_work.assign(num_nodes, 0);
}

// --- Refresh window. -------------------------------------------------------
void BubblePlanner::IterationPass::OpenRefreshWindow() {
  const bool work = st.HasWork();
  if (work && !st.window_start) st.window_start = iteration;
  // A checkpoint closes the window: nothing younger than the front survives
  // it. The next refresh takes the abandoned one's number: the workers may
  // hold layers it finalised and inverses it staged (rule 2'), which the
  // next refresh takes over — as in a job resumed from the checkpoint, whose
  // state holds them as the next refresh's.
  if (close_window && st.flight.size() > 1) {
    st.next_refresh = st.flight[1].number;
    st.flight.resize(1);
  }
  window = DecideWindow(work, st.window_start, iteration, close_window, fixed, use_bubbles,
                        st.flight.size());
  if (work && st.flight.empty()) st.flight.push_back(st.NewRefresh());
  if (window.next_joins) st.flight.push_back(st.NewRefresh());
  // Refreshes placing work this iteration: flight[0] (the front) and flight[1].
  num_refreshes = window.place ? static_cast<int>(st.flight.size()) : 0;
  curv.assign(num_refreshes, std::vector<std::vector<Curv>>(num_nodes));
  gaps.assign(num_nodes, {});
  forwards.assign(num_nodes, 0);
  backwards.assign(num_nodes, 0);
  first_inversion_end.assign(num_nodes, {});
  for (int f = 0; f < 2; ++f) {
    inv_placed[f].assign(num_nodes, {});
    inv_end[f].assign(num_nodes, {});
  }
  next_inverts = num_refreshes > 1 && fixed == 0;
}

void BubblePlanner::IterationPass::MakeTask(int f, int node, BubbleKind kind, int layer_pos,
                                            int module, int microbatch, double start,
                                            double duration, bool serial, int part, int num_parts) {
  v1::BubbleTask t;
  t.set_kind(kind);
  t.set_node(st.workload.nodes[node].node_id);
  t.set_layer(static_cast<uint32_t>(st.workload.nodes[node].layers[layer_pos]));
  t.set_module(module >= 0 ? KfacModules()[module] : "");
  t.set_microbatch(static_cast<uint32_t>(std::max(0, microbatch)));
  t.set_refresh(st.flight[f].number);
  t.set_planned_start_s(start);
  t.set_planned_duration_s(duration);
  t.set_part(static_cast<uint32_t>(part));
  t.set_num_parts(static_cast<uint32_t>(num_parts));
  t.set_serial(serial);
  tasks.push_back(std::move(t));
  if (kind == v1::BubbleTask::KIND_SYNC_FACTORS) {
    // Network time: on the critical path (serial_s) but not compute.
  } else if (serial) {
    serial_work[node] += duration;
  } else {
    out.bubble_s[node] += duration;
  }
}

void BubblePlanner::IterationPass::AddSerial(int f, int node, BubbleKind kind, int layer_pos,
                                             int module, int microbatch, double duration, int part,
                                             int num_parts) {
  MakeTask(f, node, kind, layer_pos, module, microbatch, end + serial_cursor[node], duration, true,
           part, num_parts);
  serial_cursor[node] += duration;
}

// --- Gaps and curvature candidates. ----------------------------------------
void BubblePlanner::IterationPass::CollectCurvature() {
  // Microbatches visiting each node, by id.
  std::vector<std::vector<int>> visiting(num_nodes);
  for (const sim::Route& r : plan.routes) {
    for (int n : r.nodes) {
      if (n >= 0 && n < num_nodes) visiting[n].push_back(r.microbatch);
    }
  }
  for (int n = 0; n < num_nodes && window.place; ++n) {
    const KfacNodeWork& w = st.workload.nodes[n];
    if (w.layers.empty()) continue;
    const NodeTimeline& tl = timeline.nodes[n];
    gaps[n] = use_bubbles ? Gaps(tl, end) : std::vector<Gap>();

    // Candidate microbatches with their forward / backward end on this node.
    std::vector<int> mbs = visiting[n];
    std::sort(mbs.begin(), mbs.end());
    mbs.erase(std::unique(mbs.begin(), mbs.end()), mbs.end());
    std::vector<std::pair<int, double>> fwd, bwd;  // (mb, end)
    for (int mb : mbs) {
      double f = -1, b = -1;
      for (const BusyInterval& bi : tl.busy) {
        if (bi.microbatch != mb) continue;
        if (bi.kind == BusyInterval::Kind::kForward) f = std::max(f, bi.end_s);
        if (bi.kind == BusyInterval::Kind::kBackward) b = std::max(b, bi.end_s);
      }
      if (f >= 0) fwd.push_back({mb, f});
      if (b >= 0) bwd.push_back({mb, b});
    }
    forwards[n] = static_cast<int>(fwd.size());
    backwards[n] = static_cast<int>(bwd.size());
    // The oldest refresh takes the lowest microbatch ids; the next one the
    // following ids: a microbatch feeds one refresh per layer and kind.
    for (BubbleKind kind : {v1::BubbleTask::KIND_CURVATURE_A, v1::BubbleTask::KIND_CURVATURE_B}) {
      const bool is_a = kind == v1::BubbleTask::KIND_CURVATURE_A;
      const auto& cand = is_a ? fwd : bwd;
      for (size_t l = 0; l < w.layers.size(); ++l) {
        const double d = is_a ? w.costs[l].curvature_a_s : w.costs[l].curvature_b_s;
        const std::vector<double>& shares =
            is_a ? st.parts[n][l].curvature_a : st.parts[n][l].curvature_b;
        const int num_parts = static_cast<int>(shares.size());
        size_t next = 0;
        for (int f = 0; f < num_refreshes; ++f) {
          const State::NodeState& ns = st.flight[f].nodes[n];
          const int owed = is_a ? ns.owed_a[l] : ns.owed_b[l];
          for (int i = 0; i < owed && next < cand.size(); ++i, ++next) {
            for (int p = 0; p < num_parts; ++p) {
              Curv c;
              c.kind = kind;
              c.layer = static_cast<int>(l);
              c.mb = cand[next].first;
              c.part = p;
              c.num_parts = num_parts;
              c.ready = cand[next].second;
              c.duration = d * shares[p];
              curv[f][n].push_back(c);
            }
          }
        }
      }
    }
    // Layers whose curvature was complete before this iteration.
    for (int f = 0; f < num_refreshes; ++f) {
      auto& ends = st.flight[f].nodes[n].curvature_end;
      std::fill(ends.begin(), ends.end(), 0.0);
    }
  }
}

int BubblePlanner::IterationPass::OwedAfter(int f, int n, int l, bool is_a) const {
  const State::NodeState& ns = st.flight[f].nodes[n];
  int owed = is_a ? ns.owed_a[l] : ns.owed_b[l];
  for (const Curv& c : curv[f][n]) {
    if (c.placed && c.last() && c.layer == l &&
        (c.kind == v1::BubbleTask::KIND_CURVATURE_A) == is_a) {
      --owed;
    }
  }
  return owed;
}

double BubblePlanner::IterationPass::CurvatureGate(int n, int l) const {
  if (num_refreshes < 2) return 0;
  if (st.flight[0].nodes[n].inverted[l]) return 0;
  return first_inversion_end[n][l];
}

// --- Greedy first-fit inside the gaps, per node. ---------------------------
// Priority: what was begun (a microbatch's or an inversion's next part), then
// curvature — the front's A, B, the next refresh's A, B: a microbatch's
// curvature can run only in its own iteration, inversions in any — then the
// front's inversions A, B and (adaptive interval) the next refresh's. With a
// fixed interval the next refresh's curvature comes after the front's
// inversions (they must end in the window).
void BubblePlanner::IterationPass::PlaceInGaps() {
  for (int n = 0; n < num_nodes && window.place; ++n) {
    const KfacNodeWork& w = st.workload.nodes[n];
    if (w.layers.empty()) continue;
    for (int f = 0; f < num_refreshes; ++f) {
      const size_t count = st.flight[f].nodes[n].inversions.size();
      inv_placed[f][n].assign(count, false);
      inv_end[f][n].assign(count, 0);
    }
    first_inversion_end[n].assign(w.layers.size(), kNever);
    if (!use_bubbles) continue;
    PlaceOnNode(n);
  }
}

void BubblePlanner::IterationPass::PlaceOnNode(int n) {
  const KfacNodeWork& w = st.workload.nodes[n];
  const size_t layers = w.layers.size();
  // Curvature still owed per refresh and layer (A + B microbatches) and when
  // its last placed part ends.
  std::array<std::vector<int>, 2> left;
  std::array<std::vector<double>, 2> done_at;
  for (int f = 0; f < num_refreshes; ++f) {
    const State::NodeState& ns = st.flight[f].nodes[n];
    left[f].assign(layers, 0);
    done_at[f].assign(layers, 0);
    for (size_t l = 0; l < layers; ++l) left[f][l] = ns.owed_a[l] + ns.owed_b[l];
  }
  // When inversion part i of flight[f] may start: after the layer's
  // curvature (and sync), after the item's previous part (still listed = not
  // placed before this iteration), and for the next refresh after every
  // inversion part of the layer the front still owes.
  auto inv_ready = [&](int f, size_t i) -> double {
    const State::NodeState& ns = st.flight[f].nodes[n];
    const Inversion& inv = ns.inversions[i];
    if (left[f][inv.layer] > 0 || !ns.synced[inv.layer]) return kNever;
    // With sync the factors were all-reduced at a previous step: ready at 0.
    double ready = done_at[f][inv.layer];
    if (i > 0 && NextPart(ns.inversions[i - 1], inv)) {
      if (!inv_placed[f][n][i - 1]) return kNever;
      ready = std::max(ready, inv_end[f][n][i - 1]);
    }
    if (f == 1) {
      const auto& front = st.flight[0].nodes[n].inversions;
      for (size_t k = 0; k < front.size(); ++k) {
        if (front[k].layer != inv.layer) continue;
        if (!inv_placed[0][n][k]) return kNever;
        ready = std::max(ready, inv_end[0][n][k]);
      }
    }
    return ready;
  };
  for (const auto& gap : gaps[n]) {
    // Plain variables, not structured bindings: lambdas below capture them.
    const double gs = gap.first;
    const double ge = gap.second;
    double t = gs;
    while (t < ge - kEps) {
      bool placed = false;
      double next_ready = kNever;
      // A curvature microbatch of the node has parts placed and parts left.
      auto curvature_open = [&]() {
        for (int f = 0; f < num_refreshes; ++f) {
          const std::vector<Curv>& list = curv[f][n];
          for (size_t i = 0; i + 1 < list.size(); ++i) {
            if (list[i].placed && !list[i].last() && !list[i + 1].placed) return true;
          }
        }
        return false;
      };
      // begun: only the next part of a microbatch (inversion) whose earlier
      // parts are placed; else any part whose turn it is.
      auto try_curvature = [&](int f, bool begun) {
        std::vector<Curv>& list = curv[f][n];
        for (size_t i = 0; i < list.size(); ++i) {
          Curv& c = list[i];
          if (c.placed) continue;
          if (c.part > 0 && !list[i - 1].placed) continue;  // the parts go in order
          if (begun && c.part == 0) continue;
          double ready = f == 0 ? c.ready : std::max(c.ready, CurvatureGate(n, c.layer));
          if (c.part > 0) ready = std::max(ready, list[i - 1].end);
          if (ready > t + kEps) {
            next_ready = std::min(next_ready, ready);
            continue;
          }
          if (t + c.duration * slack > ge + kEps) continue;
          // A microbatch starts only when no other is half placed and all
          // its parts fit this iteration's gaps from here (its data does not
          // outlive the iteration).
          if (c.part == 0 && c.num_parts > 1 &&
              (curvature_open() || !FitsInOrder(gaps[n], t, PartNeeds(list, i, slack)))) {
            continue;
          }
          c.placed = true;
          MakeTask(f, n, c.kind, c.layer, -1, c.mb, t, c.duration, false, c.part, c.num_parts);
          t += c.duration * slack;
          c.end = t;
          if (c.last()) --left[f][c.layer];
          done_at[f][c.layer] = std::max(done_at[f][c.layer], t);
          placed = true;
          return;
        }
      };
      auto try_inversion = [&](int f, bool begun) {
        const auto& list = st.flight[f].nodes[n].inversions;
        for (size_t i = 0; i < list.size(); ++i) {
          if (inv_placed[f][n][i]) continue;
          const Inversion& inv = list[i];
          if (begun && !(i > 0 && NextPart(list[i - 1], inv) && inv_placed[f][n][i - 1])) {
            continue;
          }
          const double ready = inv_ready(f, i);
          if (ready > t + kEps) {
            next_ready = std::min(next_ready, ready);
            continue;
          }
          const double d = InversionSeconds(w.costs[inv.layer], inv);
          if (t + d * slack > ge + kEps) continue;
          inv_placed[f][n][i] = true;
          MakeTask(f, n, inv.kind, inv.layer, inv.module, -1, t, d, false, inv.part, inv.num_parts);
          t += d * slack;
          inv_end[f][n][i] = t;
          if (f == 0) {
            first_inversion_end[n][inv.layer] = std::min(first_inversion_end[n][inv.layer], t);
          }
          placed = true;
          return;
        }
      };
      // What was begun goes on first: a microbatch's parts (its data lives
      // only this iteration), then an inversion's (fewer half-done inversions
      // held by the worker). Then the priority order.
      try_curvature(0, true);
      if (!placed && num_refreshes > 1) try_curvature(1, true);
      if (!placed) try_inversion(0, true);
      if (!placed && next_inverts) try_inversion(1, true);
      if (!placed) try_curvature(0, false);
      // With a fixed interval the front must finish in its window (or run
      // serially): its inversions before the next refresh's curvature.
      if (!placed && num_refreshes > 1 && fixed == 0) try_curvature(1, false);
      if (!placed) try_inversion(0, false);
      if (!placed && num_refreshes > 1 && fixed > 0) try_curvature(1, false);
      if (!placed && next_inverts) try_inversion(1, false);
      if (placed) continue;
      if (next_ready >= ge - kEps) break;
      t = std::max(t, next_ready);
    }
  }
  for (int f = 0; f < num_refreshes; ++f) {
    for (size_t l = 0; l < layers; ++l) {
      st.flight[f].nodes[n].curvature_end[l] = done_at[f][l];
    }
  }
}

// --- Curvature: book what was placed, serialise what must be. -------------
void BubblePlanner::IterationPass::BookCurvature() {
  for (int f = 0; f < num_refreshes; ++f) {
    const bool last_chance = f == 0 && window.final_iteration;
    for (int n = 0; n < num_nodes; ++n) {
      const KfacNodeWork& w = st.workload.nodes[n];
      if (w.layers.empty()) continue;
      State::NodeState& ns = st.flight[f].nodes[n];
      // A microbatch whose first parts ran in a gap finishes now (serially
      // if need be): its saved inputs and gradients live only this iteration.
      std::vector<Curv>& list = curv[f][n];
      for (size_t i = 0; i < list.size(); ++i) {
        Curv& c = list[i];
        if (c.placed || c.part == 0 || !list[i - 1].placed) continue;
        c.placed = true;
        AddSerial(f, n, c.kind, c.layer, -1, c.mb, c.duration, c.part, c.num_parts);
      }
      for (BubbleKind kind : {v1::BubbleTask::KIND_CURVATURE_A, v1::BubbleTask::KIND_CURVATURE_B}) {
        const bool is_a = kind == v1::BubbleTask::KIND_CURVATURE_A;
        for (size_t l = 0; l < w.layers.size(); ++l) {
          const int l_int = static_cast<int>(l);
          int owed = OwedAfter(f, n, l_int, is_a);
          if (owed <= 0) {
            (is_a ? ns.owed_a : ns.owed_b)[l] = 0;
            continue;
          }
          // The next refresh: not before the front's first inversion of the
          // layer on this node (in the bubbles this iteration or earlier). A
          // front inversion that runs serially now only lets it in next time.
          const double gate = f == 0 ? 0 : CurvatureGate(n, l_int);
          if (gate == kNever) {
            (is_a ? ns.owed_a : ns.owed_b)[l] = owed;
            continue;
          }
          int& misses = is_a ? ns.miss_a[l] : ns.miss_b[l];
          bool any_candidate = false;
          bool fits = false;
          for (size_t i = 0; i < list.size(); ++i) {
            const Curv& c = list[i];
            if (c.placed || c.layer != l_int || c.kind != kind) continue;
            any_candidate = true;
            // A microbatch fits when all its parts do, in order.
            if (c.part == 0) {
              fits =
                  fits || FitsInOrder(gaps[n], std::max(c.ready, gate), PartNeeds(list, i, slack));
            }
          }
          // The older refresh taking every microbatch of the node is no miss.
          const int ran = is_a ? forwards[n] : backwards[n];
          const bool taken = f > 0 && !any_candidate && ran > 0;
          if (!fits && !taken) ++misses;
          const bool go_serial = last_chance || misses >= st.options.serial_after;
          if (go_serial) {
            for (Curv& c : curv[f][n]) {
              if (c.placed || c.layer != l_int || c.kind != kind) continue;
              c.placed = true;
              AddSerial(f, n, kind, l_int, -1, c.mb, c.duration, c.part, c.num_parts);
              if (c.last()) --owed;
            }
            // What no microbatch of this iteration can provide (the node was
            // visited by too few, or by none for serial_after iterations) is
            // waived: the refresh goes ahead with fewer curvature microbatches.
            if (!any_candidate || last_chance) owed = 0;
            misses = 0;
          }
          (is_a ? ns.owed_a : ns.owed_b)[l] = std::max(0, owed);
        }
      }
    }
  }
}

// --- Factor sync: serial, all replicas of a stage at once. -----------------
// Layers synced in this iteration, per refresh in flight: their inversions
// run from the next iteration on.
void BubblePlanner::IterationPass::SyncFactors() {
  for (auto& per_node : synced_now) {
    per_node.resize(num_nodes);
    for (int n = 0; n < num_nodes; ++n) {
      per_node[n].assign(st.workload.nodes[n].layers.size(), false);
    }
  }
  if (!window.place || !st.kfac.sync_factors()) return;
  // Group replicas by stage, and sync layers in layer order.
  std::map<int, std::vector<int>> stage_nodes;
  for (int n = 0; n < num_nodes; ++n) {
    if (st.NeedsSync(n)) stage_nodes[st.workload.nodes[n].stage].push_back(n);
  }
  for (int f = 0; f < num_refreshes; ++f) {
    for (const auto& [stage, members] : stage_nodes) {
      const KfacNodeWork& first = st.workload.nodes[members[0]];
      for (size_t l = 0; l < first.layers.size(); ++l) {
        const int layer = first.layers[l];
        // Position of the layer on every replica; all must be done.
        bool ready = true;
        bool all_synced = true;
        std::vector<int> pos;
        for (int m : members) {
          const auto& ls = st.workload.nodes[m].layers;
          auto it = std::find(ls.begin(), ls.end(), layer);
          if (it == ls.end()) {
            ready = false;
            break;
          }
          const int p = static_cast<int>(it - ls.begin());
          pos.push_back(p);
          const State::NodeState& ns = st.flight[f].nodes[m];
          if (ns.owed_a[p] > 0 || ns.owed_b[p] > 0) ready = false;
          if (!ns.synced[p]) all_synced = false;
          if (f > 0) {
            // The next refresh's factors are all-reduced with the pending
            // sums: only once the front inverted the layer on every replica
            // in an earlier iteration (rule 1 on all replicas), and not in an
            // iteration with front inversions of the layer in the bubbles
            // (the worker holds inversions of a syncing layer until the
            // all-reduce).
            const State::NodeState& front = st.flight[0].nodes[m];
            if (!front.inverted[p]) ready = false;
            for (size_t i = 0; i < front.inversions.size(); ++i) {
              if (inv_placed[0][m][i] && front.inversions[i].layer == p) ready = false;
            }
          }
        }
        if (!ready || all_synced) continue;
        double start = 0, duration = 0;
        for (size_t i = 0; i < members.size(); ++i) {
          start = std::max(start, serial_cursor[members[i]]);
          duration = std::max(duration, st.workload.nodes[members[i]].costs[pos[i]].sync_s);
        }
        for (size_t i = 0; i < members.size(); ++i) {
          const int m = members[i];
          serial_cursor[m] = start;
          AddSerial(f, m, v1::BubbleTask::KIND_SYNC_FACTORS, pos[i], -1, -1, duration);
          st.flight[f].nodes[m].synced[pos[i]] = true;
          synced_now[f][m][pos[i]] = true;
        }
      }
    }
  }
}

// --- Inversions: book, count misses, serialise (the front's first). --------
void BubblePlanner::IterationPass::BookInversions() {
  // Per node and layer, before the front's list is booked: whether all the
  // front's inversions of the layer are placed in gaps (none left, none
  // serial now), and when the last of them ends (rule 2' for the next).
  std::vector<std::vector<bool>> front_done(num_nodes);
  std::vector<std::vector<double>> front_end(num_nodes);
  for (int n = 0; n < num_nodes && window.place && next_inverts; ++n) {
    front_done[n].assign(st.workload.nodes[n].layers.size(), true);
    front_end[n].assign(st.workload.nodes[n].layers.size(), 0);
    const auto& front = st.flight[0].nodes[n].inversions;
    for (size_t k = 0; k < front.size() && k < inv_placed[0][n].size(); ++k) {
      if (!inv_placed[0][n][k]) front_done[n][front[k].layer] = false;
      front_end[n][front[k].layer] = std::max(front_end[n][front[k].layer], inv_end[0][n][k]);
    }
  }
  for (int f = 0; f < num_refreshes && window.place; ++f) {
    if (f == 1 && !next_inverts) break;
    for (int n = 0; n < num_nodes; ++n) {
      const KfacNodeWork& w = st.workload.nodes[n];
      if (w.layers.empty()) continue;
      State::NodeState& ns = st.flight[f].nodes[n];
      std::vector<Inversion> remaining;
      std::vector<bool> inverted_now(w.layers.size(), false);
      // The item's previous part went serial now: the rest follows it there.
      bool cascade = false;
      for (size_t i = 0; i < ns.inversions.size(); ++i) {
        auto inv = ns.inversions[i];
        const bool continues = i > 0 && NextPart(ns.inversions[i - 1], inv);
        if (!continues) cascade = false;
        const int l = inv.layer;
        if (inv_placed[f][n][i]) {
          inverted_now[l] = true;
          continue;
        }
        const double d = InversionSeconds(w.costs[l], inv);
        if ((f == 0 && window.final_iteration) || cascade) {
          AddSerial(f, n, inv.kind, l, inv.module, -1, d, inv.part, inv.num_parts);
          inverted_now[l] = true;
          cascade = true;
          continue;
        }
        // Ready during this iteration's gaps? (Synced just now: from the
        // next; a later part: once its previous part ran.)
        const bool curvature_done = ns.owed_a[l] == 0 && ns.owed_b[l] == 0;
        bool was_ready =
            curvature_done && ns.synced[l] && (f == 0 || front_done[n][l]) && !synced_now[f][n][l];
        double ready_at = ns.curvature_end[l];
        if (continues) {
          if (inv_placed[f][n][i - 1]) {
            ready_at = std::max(ready_at, inv_end[f][n][i - 1]);
          } else {
            was_ready = false;
          }
        }
        if (f == 1) ready_at = std::max(ready_at, front_end[n][l]);
        if (was_ready && use_bubbles) {
          if (!FitsSomeGap(gaps[n], ready_at, d * slack)) ++inv.misses;
          if (inv.misses >= st.options.serial_after) {
            AddSerial(f, n, inv.kind, l, inv.module, -1, d, inv.part, inv.num_parts);
            inverted_now[l] = true;
            cascade = true;
            continue;
          }
        }
        remaining.push_back(inv);
      }
      ns.inversions = std::move(remaining);
      for (size_t l = 0; l < w.layers.size(); ++l) {
        if (inverted_now[l]) ns.inverted[l] = true;
      }
    }
  }
}

// --- Activation of the front. ----------------------------------------------
void BubblePlanner::IterationPass::ActivateFront() {
  if (num_refreshes == 0) return;
  bool complete = true;
  for (int n = 0; n < num_nodes && complete; ++n) {
    const State::NodeState& ns = st.flight[0].nodes[n];
    if (!ns.inversions.empty()) complete = false;
    for (size_t l = 0; l < ns.owed_a.size() && complete; ++l) {
      if (ns.owed_a[l] > 0 || ns.owed_b[l] > 0 || !ns.synced[l]) complete = false;
    }
  }
  if (complete && (fixed == 0 || window.final_iteration)) {
    out.activate_refresh = st.flight[0].number;
    st.last_activated = st.flight[0].number;
    st.intervals.push_back(static_cast<int>(window.age));
    st.window_start.reset();
    st.flight.erase(st.flight.begin());
  }
}

// --- Totals and order. -----------------------------------------------------
IterationBubbles BubblePlanner::IterationPass::Finish() {
  double busy = 0, kfac_s = 0, longest_tail = 0;
  int holders = 0;
  for (int n = 0; n < num_nodes; ++n) {
    const KfacNodeWork& w = st.workload.nodes[n];
    if (w.layers.empty()) continue;
    ++holders;
    for (const KfacLayerCost& c : w.costs) out.precondition_s[n] += c.precondition_s;
    out.serial_s[n] = serial_cursor[n];
    busy += PipelineBusy(timeline.nodes[n], end);
    kfac_s += out.bubble_s[n] + serial_work[n] + out.precondition_s[n];
    longest_tail = std::max(longest_tail, out.serial_s[n] + out.precondition_s[n]);
  }
  out.iteration_time_s = end + longest_tail;
  if (holders > 0 && end > 0) out.utilization_before = busy / (holders * end);
  if (holders > 0 && out.iteration_time_s > 0) {
    out.utilization_after = (busy + kfac_s) / (holders * out.iteration_time_s);
  }
  std::vector<std::string> node_order;
  for (int n = 0; n < num_nodes; ++n) node_order.push_back(st.workload.nodes[n].node_id);
  OrderTasks(node_order, &tasks);
  out.tasks = std::move(tasks);
  return std::move(out);
}

}  // namespace detour::planner
