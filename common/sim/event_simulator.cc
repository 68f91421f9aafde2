#include "common/sim/event_simulator.h"

#include <algorithm>
#include <queue>
#include <unordered_map>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace detour::sim {

const char* ActivityKindName(ActivityKind kind) {
  switch (kind) {
    case ActivityKind::kForward: return "forward";
    case ActivityKind::kBackward: return "backward";
    case ActivityKind::kLoss: return "loss";
    case ActivityKind::kSendActivation: return "send_activation";
    case ActivityKind::kSendGradient: return "send_gradient";
    case ActivityKind::kAllReduce: return "allreduce";
  }
  return "unknown";
}

namespace {

using TaskKind = WorkKind;

struct Task {
  ReadyWork work;
  int route = 0;
  int pos = 0;
  // A forward that must wait for a memory slot (ForwardNeedsSlot).
  bool needs_slot = false;
  // Had to wait for the node's compute: it arrived while the node was busy,
  // or another ready task went first.
  bool collided = false;
};

enum class EventType : uint8_t { kArrive, kDone };

struct Event {
  double t = 0;
  int64_t seq = 0;
  EventType type = EventType::kArrive;
  int node = 0;
  Task task;
};

struct EventLater {
  bool operator()(const Event& a, const Event& b) const {
    if (a.t != b.t) return a.t > b.t;
    return a.seq > b.seq;
  }
};

struct NodeState {
  bool busy = false;
  int free_slots = 0;
  // Ready tasks in arrival order; few per node, so a scan picks the next.
  std::vector<Task> ready;
};

// Buffers one thread's simulations reuse: the planner runs tens of
// thousands of small simulations, where allocation would dominate.
struct Workspace {
  std::vector<int> node_stage;
  std::vector<NodeState> nodes;
  std::vector<int> slot_offset;
  std::vector<char> slot_taken;
  std::vector<Event> events;
  std::vector<double> uplink_free;
  std::unordered_map<int64_t, double> link_free;
  std::vector<int> touched;
  std::vector<int> order;
};

Workspace& ThreadWorkspace() {
  thread_local Workspace workspace;
  return workspace;
}

class Simulation {
 public:
  Simulation(const CostModel& cost, const Plan& plan, const SimOptions& options)
      : cost_(cost),
        plan_(plan),
        options_(options),
        ws_(ThreadWorkspace()),
        node_stage_(ws_.node_stage),
        nodes_(ws_.nodes),
        events_(ws_.events),
        uplink_free_(ws_.uplink_free),
        link_free_(ws_.link_free) {}

  absl::StatusOr<SimResult> Run();

 private:
  absl::Status Check();
  void Push(EventType type, double t, int node, const Task& task) {
    Event e;
    e.t = t;
    e.seq = seq_++;
    e.type = type;
    e.node = node;
    e.task = task;
    events_.push_back(e);
    std::push_heap(events_.begin(), events_.end(), EventLater());
  }
  Event PopEvent() {
    std::pop_heap(events_.begin(), events_.end(), EventLater());
    Event e = events_.back();
    events_.pop_back();
    return e;
  }
  char& SlotTaken(int route, int pos) { return ws_.slot_taken[ws_.slot_offset[route] + pos]; }
  void Arrive(double t, int node, int route, int pos, TaskKind kind) {
    Task task;
    task.work.ready = t;
    task.work.kind = kind;
    task.route = route;
    task.pos = pos;
    if (kind == TaskKind::kForward) {
      task.needs_slot = ForwardNeedsSlot(plan_.routes[route].stages, pos);
    }
    Push(EventType::kArrive, t, node, task);
  }
  void Send(double t, int from, int to, int route, int pos, TaskKind kind, bool gradient);
  void Finish(double t, int node, const Task& task);
  void Dispatch(double t, int node);

  const CostModel& cost_;
  const Plan& plan_;
  const SimOptions& options_;
  Workspace& ws_;
  std::vector<int>& node_stage_;
  std::vector<NodeState>& nodes_;
  // A binary heap (EventLater) of pending events.
  std::vector<Event>& events_;
  std::vector<double>& uplink_free_;
  std::unordered_map<int64_t, double>& link_free_;
  int64_t seq_ = 0;
  int routes_done_ = 0;
  SimResult result_;
};

absl::Status Simulation::Check() {
  const int n = cost_.num_nodes();
  const auto& stages = plan_.assignment.stage_nodes;
  if (plan_.assignment.num_stages() != cost_.num_stages()) {
    return absl::InvalidArgumentError(absl::StrFormat("assignment has %d stages, the cost model %d",
                                                      plan_.assignment.num_stages(),
                                                      cost_.num_stages()));
  }
  node_stage_.assign(n, -1);
  for (int s = 0; s < static_cast<int>(stages.size()); ++s) {
    for (int node : stages[s]) {
      if (node < 0 || node >= n) {
        return absl::InvalidArgumentError(
            absl::StrFormat("assignment: stage %d names node index %d of %d", s, node, n));
      }
      if (node_stage_[node] != -1) {
        return absl::InvalidArgumentError(
            absl::StrFormat("assignment: node %s holds stages %d and %d", cost_.node_id(node),
                            node_stage_[node], s));
      }
      node_stage_[node] = s;
    }
  }
  for (size_t r = 0; r < plan_.routes.size(); ++r) {
    const Route& route = plan_.routes[r];
    if (route.nodes.empty() || route.nodes.size() != route.stages.size()) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "microbatch %d: route needs nodes and one stage per node", route.microbatch));
    }
    for (size_t i = 0; i < route.nodes.size(); ++i) {
      const int node = route.nodes[i];
      if (node < 0 || node >= n) {
        return absl::InvalidArgumentError(
            absl::StrFormat("microbatch %d: node index %d out of range", route.microbatch, node));
      }
      if (node_stage_[node] != route.stages[i]) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "microbatch %d: node %s holds stage %d, the route says %d", route.microbatch,
            cost_.node_id(node), node_stage_[node], route.stages[i]));
      }
      for (size_t j = 0; j < i; ++j) {
        if (route.nodes[j] == node) {
          return absl::InvalidArgumentError(absl::StrFormat("microbatch %d: node %s visited twice",
                                                            route.microbatch, cost_.node_id(node)));
        }
      }
    }
    if (route.stages[0] != 0) {
      return absl::InvalidArgumentError(
          absl::StrFormat("microbatch %d: route starts on %s (stage %d), not on a data node",
                          route.microbatch, cost_.node_id(route.nodes[0]), route.stages[0]));
    }
  }
  return absl::OkStatus();
}

void Simulation::Send(double t, int from, int to, int route, int pos, TaskKind kind,
                      bool gradient) {
  const double ser = cost_.SerializationTime(from, to);
  double start = t;
  switch (options_.contention) {
    case Contention::kNone: break;
    case Contention::kSenderUplink:
      start = std::max(t, uplink_free_[from]);
      uplink_free_[from] = start + ser;
      break;
    case Contention::kPerLink: {
      double& free = link_free_[static_cast<int64_t>(from) * cost_.num_nodes() + to];
      start = std::max(t, free);
      free = start + ser;
      break;
    }
  }
  if (options_.record_timeline) {
    Activity a;
    a.start_s = start;
    a.end_s = start + ser;
    a.kind = gradient ? ActivityKind::kSendGradient : ActivityKind::kSendActivation;
    a.microbatch = plan_.routes[route].microbatch;
    a.stage = node_stage_[from];
    a.peer = to;
    result_.sends[from].push_back(a);
  }
  Arrive(start + ser + cost_.Latency(from, to), to, route, pos, kind);
}

void Simulation::Finish(double t, int node, const Task& task) {
  NodeState& ns = nodes_[node];
  ns.busy = false;
  const Route& route = plan_.routes[task.route];
  const int len = static_cast<int>(route.nodes.size());
  const int data_node = route.nodes[0];
  switch (task.work.kind) {
    case TaskKind::kForward:
      if (task.pos + 1 < len) {
        Send(t, node, route.nodes[task.pos + 1], task.route, task.pos + 1, TaskKind::kForward,
             false);
      } else if (len == 1) {
        Arrive(t, data_node, task.route, 0, TaskKind::kLoss);
      } else {
        Send(t, node, data_node, task.route, 0, TaskKind::kLoss, false);
      }
      break;
    case TaskKind::kLoss:
      result_.routes[task.route].loss_end_s = t;
      if (len == 1) {
        Arrive(t, data_node, task.route, 0, TaskKind::kBackward);
      } else {
        Send(t, node, route.nodes[len - 1], task.route, len - 1, TaskKind::kBackward, true);
      }
      break;
    case TaskKind::kBackward: {
      if (SlotTaken(task.route, task.pos)) ++ns.free_slots;
      double& done = result_.stage_done_s[route.stages[task.pos]];
      done = std::max(done, t);
      if (task.pos > 0) {
        Send(t, node, route.nodes[task.pos - 1], task.route, task.pos - 1, TaskKind::kBackward,
             true);
      } else {
        result_.routes[task.route].end_s = t;
        ++routes_done_;
      }
      break;
    }
  }
}

void Simulation::Dispatch(double t, int node) {
  NodeState& ns = nodes_[node];
  if (ns.busy) return;
  int best = -1;
  for (int i = 0; i < static_cast<int>(ns.ready.size()); ++i) {
    const Task& c = ns.ready[i];
    if (c.needs_slot && ns.free_slots <= 0) continue;
    if (best < 0 || RunsBefore(options_.queue_policy, c.work, ns.ready[best].work)) best = i;
  }
  if (best < 0) return;
  const Task task = ns.ready[best];
  ns.ready.erase(ns.ready.begin() + best);
  if (task.work.kind == TaskKind::kForward && task.needs_slot) {
    --ns.free_slots;
    SlotTaken(task.route, task.pos) = 1;
  }
  // Whatever could still run now waits for the compute: a collision. (Work
  // that waits for a slot the chosen task just took does not count.)
  for (Task& c : ns.ready) {
    if (!(c.needs_slot && ns.free_slots <= 0)) c.collided = true;
  }
  if (task.collided) ++result_.collisions;
  if (t > task.work.ready + 1e-9) result_.queue_wait_s += t - task.work.ready;
  const Route& route = plan_.routes[task.route];
  const int stage = route.stages[task.pos];
  double duration = 0;
  ActivityKind kind = ActivityKind::kForward;
  switch (task.work.kind) {
    case TaskKind::kForward:
      duration = cost_.ForwardTime(node, stage);
      kind = ActivityKind::kForward;
      if (task.pos == 0) result_.routes[task.route].start_s = t;
      break;
    case TaskKind::kLoss:
      duration = cost_.LossTime(node);
      kind = ActivityKind::kLoss;
      break;
    case TaskKind::kBackward:
      duration = cost_.BackwardTime(node, stage);
      kind = ActivityKind::kBackward;
      break;
  }
  ns.busy = true;
  result_.busy_s[node] += duration;
  if (options_.record_timeline) {
    Activity a;
    a.start_s = t;
    a.end_s = t + duration;
    a.kind = kind;
    a.microbatch = route.microbatch;
    a.stage = stage;
    result_.compute[node].push_back(a);
  }
  Push(EventType::kDone, t + duration, node, task);
}

absl::StatusOr<SimResult> Simulation::Run() {
  if (absl::Status s = Check(); !s.ok()) return s;
  const int n = cost_.num_nodes();
  const int num_routes = static_cast<int>(plan_.routes.size());
  nodes_.resize(n);
  for (int i = 0; i < n; ++i) {
    nodes_[i].busy = false;
    nodes_[i].free_slots = cost_.memory_slots(i);
    nodes_[i].ready.clear();
  }
  ws_.slot_offset.resize(num_routes + 1);
  ws_.slot_offset[0] = 0;
  for (int r = 0; r < num_routes; ++r) {
    ws_.slot_offset[r + 1] = ws_.slot_offset[r] + static_cast<int>(plan_.routes[r].nodes.size());
  }
  ws_.slot_taken.assign(ws_.slot_offset[num_routes], 0);
  events_.clear();
  link_free_.clear();
  uplink_free_.assign(n, 0.0);
  result_.busy_s.assign(n, 0.0);
  result_.routes.resize(num_routes);
  result_.stage_done_s.assign(cost_.num_stages(), 0.0);
  result_.allreduce_s.assign(cost_.num_stages(), 0.0);
  if (options_.record_timeline) {
    result_.compute.resize(n);
    result_.sends.resize(n);
  }
  // Microbatches enter their data node in microbatch order.
  std::vector<int>& order = ws_.order;
  order.resize(num_routes);
  for (int r = 0; r < num_routes; ++r) order[r] = r;
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
    return plan_.routes[a].microbatch < plan_.routes[b].microbatch;
  });
  for (int r : order) {
    result_.routes[r].microbatch = plan_.routes[r].microbatch;
    Arrive(0.0, plan_.routes[r].nodes[0], r, 0, TaskKind::kForward);
  }

  std::vector<int>& touched = ws_.touched;
  double now = 0;
  while (!events_.empty()) {
    now = events_.front().t;
    touched.clear();
    while (!events_.empty() && events_.front().t == now) {
      Event e = PopEvent();
      ++result_.events;
      touched.push_back(e.node);
      if (e.type == EventType::kArrive) {
        NodeState& ns = nodes_[e.node];
        Task task = e.task;
        task.work.seq = e.seq;
        task.collided = ns.busy;
        ns.ready.push_back(task);
      } else {
        Finish(now, e.node, e.task);
      }
    }
    std::sort(touched.begin(), touched.end());
    touched.erase(std::unique(touched.begin(), touched.end()), touched.end());
    for (int node : touched) Dispatch(now, node);
  }

  if (routes_done_ != num_routes) {
    std::string stuck;
    int listed = 0;
    for (int r = 0; r < num_routes && listed < 8; ++r) {
      if (result_.routes[r].end_s == 0) {
        absl::StrAppend(&stuck, listed ? ", " : "", plan_.routes[r].microbatch);
        ++listed;
      }
    }
    return absl::FailedPreconditionError(absl::StrFormat(
        "routes deadlock on memory slots: %d of %d microbatches never finish (e.g. %s); "
        "a swap makes two microbatches wait for each other's slots",
        num_routes - routes_done_, num_routes, stuck));
  }

  double pipeline = 0;
  for (const RouteTiming& rt : result_.routes) pipeline = std::max(pipeline, rt.end_s);
  result_.pipeline_time_s = pipeline;
  double iteration = pipeline;
  const auto& stages = plan_.assignment.stage_nodes;
  for (int s = 0; s < cost_.num_stages(); ++s) {
    const double ar = cost_.AllReduceTime(stages[s], s);
    result_.allreduce_s[s] = ar;
    iteration = std::max(iteration, result_.stage_done_s[s] + ar);
    if (options_.record_timeline && ar > 0) {
      for (int node : stages[s]) {
        Activity a;
        a.start_s = result_.stage_done_s[s];
        a.end_s = a.start_s + ar;
        a.kind = ActivityKind::kAllReduce;
        a.stage = s;
        result_.compute[node].push_back(a);
      }
    }
  }
  result_.iteration_time_s = iteration;
  int assigned = 0;
  double busy = 0;
  for (int node = 0; node < n; ++node) {
    if (node_stage_[node] < 0) continue;
    ++assigned;
    busy += result_.busy_s[node];
  }
  if (assigned > 0 && iteration > 0) result_.utilization = busy / (assigned * iteration);
  if (assigned > 0 && pipeline > 0) result_.pipeline_utilization = busy / (assigned * pipeline);

  if (options_.record_timeline) {
    result_.idle.resize(n);
    for (int node = 0; node < n; ++node) {
      if (node_stage_[node] < 0) continue;
      double t = 0;
      for (const Activity& a : result_.compute[node]) {
        if (a.kind == ActivityKind::kAllReduce) continue;
        if (a.start_s > t) result_.idle[node].push_back({t, a.start_s});
        t = std::max(t, a.end_s);
      }
      if (pipeline > t) result_.idle[node].push_back({t, pipeline});
    }
  }
  return std::move(result_);
}

}  // namespace

absl::StatusOr<SimResult> Simulate(const CostModel& cost, const Plan& plan,
                                   const SimOptions& options) {
  Simulation sim(cost, plan, options);
  return sim.Run();
}

}  // namespace detour::sim
