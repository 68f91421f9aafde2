#include "tests/coordinator/fake_cluster.h"

#include <filesystem>
#include <system_error>

#include "common/checkpoint_manifest.h"
#include "common/model_config.h"

namespace detour::testing {

// A small job: the tiny model, `stages` stages, one data node, `replicas`
// per other stage, routes visiting all stages unless `skip` > 0.
v1::JobSpec Spec(int stages, int replicas, double skip, int iterations) {
  v1::JobSpec spec;
  spec.set_name("runner-test");
  spec.set_iterations(static_cast<uint64_t>(iterations));
  spec.mutable_model()->set_preset("tiny");
  v1::PipelineSpec* p = spec.mutable_pipeline();
  p->set_num_stages(static_cast<uint32_t>(stages));
  p->set_data_nodes(1);
  p->set_replicas_per_stage(static_cast<uint32_t>(replicas));
  p->set_microbatches_per_data_node(4);
  p->set_samples_per_microbatch(1);
  p->set_skip_ratio(skip);
  if (skip == 0) p->set_scheduler(v1::SCHEDULER_FULL);
  spec.mutable_checkpoint()->set_disabled(true);
  spec.mutable_elastic()->set_reconnect_grace_ms(100);
  spec.mutable_elastic()->set_pause_timeout_s(60);
  return spec;
}

// Pins stage s to the workers of `stages[s]`.
void Pin(v1::JobSpec* spec, const std::vector<std::vector<std::string>>& stages) {
  v1::PipelineSpec* p = spec->mutable_pipeline();
  p->clear_assignment();
  for (const auto& nodes : stages) {
    v1::StageNodes* s = p->add_assignment();
    for (const std::string& id : nodes) s->add_nodes(id);
  }
}

absl::Status FakeCluster::Send(const std::string& worker, const v1::CoordinatorMessage& m) {
  std::vector<std::pair<std::string, v1::WorkerMessage>> replies;
  JobRunner* runner = nullptr;
  bool poke = false;
  std::string revive;
  bool step_in_record = false;
  if (m.has_step()) {
    auto job = store_.Get(m.step().job_id());
    step_in_record = job.ok() && job->has_pending_step() &&
                     job->pending_step().iteration() == m.step().iteration() &&
                     job->pending_step().squared_norm() == m.step().squared_norm() &&
                     job->pending_step().epoch() == m.step().epoch();
  }
  {
    absl::MutexLock lock(&mu_);
    if (m.has_step() && !step_in_record) ++steps_not_in_record_;
    runner = runner_;
    auto it = workers_.find(worker);
    if (it == workers_.end() || !it->second.alive) {
      return absl::UnavailableError(absl::StrCat(worker, " has no open session"));
    }
    ++sent_count_[m.GetDescriptor()->FindFieldByNumber(m.kind_case())->name()];
    poke = Answer(it->second, m, &replies);
    if (auto r = revivals_.find(m.has_plan() ? m.plan().iteration() : 0);
        m.has_plan() && r != revivals_.end()) {
      revive = r->second;
      revivals_.erase(r);
    }
  }
  if (!revive.empty()) AddWorker(revive);
  if (poke) {
    std::string token;
    {
      absl::MutexLock lock(&mu_);
      token = workers_[worker].token;
    }
    registry_.SessionEnded(token, clock_->Now());
  }
  if (runner != nullptr) {
    for (auto& [from, reply] : replies) runner->Post(from, reply);
    if (poke) runner->Poke();
  }
  return absl::OkStatus();
}

std::vector<v1::WorkerInfo> FakeCluster::ReserveIdle(const std::string& job, size_t count,
                                                     const std::set<std::string>& exclude) {
  std::vector<v1::WorkerInfo> taken;
  absl::MutexLock lock(&mu_);
  for (const v1::WorkerInfo& w : registry_.List(false)) {
    if (taken.size() >= count) break;
    const FakeWorker& f = workers_[w.worker_id()];
    if (!f.alive || f.stage >= 0 || reserved_.count(w.worker_id()) ||
        exclude.count(w.worker_id())) {
      continue;
    }
    reserved_.insert(w.worker_id());
    taken.push_back(w);
  }
  return taken;
}

bool FakeCluster::Answer(FakeWorker& w, const v1::CoordinatorMessage& m,
                         std::vector<std::pair<std::string, v1::WorkerMessage>>* replies) {
  auto reply = [&](const std::string& from) -> v1::WorkerMessage& {
    replies->emplace_back(from, v1::WorkerMessage());
    return replies->back().second;
  };
  switch (m.kind_case()) {
    case v1::CoordinatorMessage::kAssignment: {
      const v1::StageAssignment& a = m.assignment();
      spec_ = a.spec();
      if (!a.restore_from().empty()) restored_.push_back(a.restore_from());
      w.stage = static_cast<int>(a.stage());
      w.epoch = a.epoch();
      w.routes.clear();
      // Fresh or restored parameters: the same for every replica of a
      // stage; a donor's state replaces them (kSendState).
      w.checksum = 1000 + a.stage();
      v1::StageReady* ready = reply(w.id).mutable_stage_ready();
      ready->set_job_id(a.job_id());
      ready->set_stage(a.stage());
      return false;
    }
    case v1::CoordinatorMessage::kSendState: {
      FakeWorker& to = workers_[m.send_state().to()];
      to.checksum = w.checksum;
      v1::StateReceived* got = reply(to.id).mutable_state_received();
      got->set_job_id(m.send_state().job_id());
      got->set_stage(static_cast<uint32_t>(to.stage));
      got->set_parameter_checksum(w.checksum);
      return false;
    }
    case v1::CoordinatorMessage::kPlan: {
      const v1::IterationPlan& p = m.plan();
      planned_iterations_.push_back(p.iteration());
      for (KillOnPlan& k : kills_) {
        if (k.done) continue;
        std::string victim = k.worker;
        for (const v1::Route& r : p.routes()) {
          if (victim.empty() && r.microbatch() == 0) {
            for (int i = 0; i < r.stages_size(); ++i) {
              if (static_cast<int>(r.stages(i)) == k.route_stage) victim = r.nodes(i);
            }
          }
        }
        if (victim == w.id && k.iteration == p.iteration()) {
          k.done = true;
          w.alive = false;
          return true;
        }
      }
      w.job_id = p.job_id();
      w.iteration = p.iteration();
      w.epoch = p.epoch();
      w.stepped = false;
      w.waiting_step = true;
      w.routes.clear();
      for (const v1::Route& r : p.routes()) w.routes[r.microbatch()] = r;
      w.first_of_stage.clear();
      for (const v1::ReplicaGroup& g : p.replica_groups()) {
        if (w.first_of_stage.size() <= g.stage()) w.first_of_stage.resize(g.stage() + 1);
        w.first_of_stage[g.stage()] = g.nodes().empty() ? "" : g.nodes(0);
      }
      checkpoint_ = p.checkpoint();
      routes_[{p.iteration(), p.epoch()}] = {p.routes().begin(), p.routes().end()};
      if (w.mute) return false;
      for (UnreachableOnPlan& u : unreachable_) {
        if (u.done || u.reporter != w.id || u.iteration != p.iteration()) continue;
        u.done = true;
        if (u.bad_frame) {
          v1::BadFrame* bad = reply(w.id).mutable_bad_frame();
          bad->set_job_id(p.job_id());
          bad->set_iteration(p.iteration());
          bad->set_sender(u.peer);
          bad->set_direction(u.direction);
          bad->set_epoch(p.epoch());
          bad->set_message("it holds NaN");
          return false;
        }
        v1::PeerUnreachable* report = reply(w.id).mutable_peer_unreachable();
        report->set_job_id(p.job_id());
        report->set_iteration(p.iteration());
        report->set_peer(u.peer);
        report->set_message("connection timed out");
        return false;
      }
      Norm(w, reply(w.id));
      return false;
    }
    case v1::CoordinatorMessage::kMembership: {
      const v1::MembershipChange& c = m.membership();
      w.epoch = c.epoch();
      v1::MembershipAck* ack = reply(w.id).mutable_membership_ack();
      ack->set_job_id(c.job_id());
      ack->set_iteration(c.iteration());
      ack->set_epoch(c.epoch());
      return false;  // nothing ran yet: every crossing microbatch runs again
    }
    case v1::CoordinatorMessage::kReroute: {
      const v1::RouteAmendment& a = m.reroute();
      w.epoch = a.epoch();
      for (const v1::Route& r : a.routes()) w.routes[r.microbatch()] = r;
      if (!w.stepped) Norm(w, reply(w.id));  // reduced again among the survivors
      return false;
    }
    case v1::CoordinatorMessage::kStep: {
      const v1::StepCommand& s = m.step();
      // The worker's runtime drops a step that is not for the iteration
      // it waits in (RuntimeStep::OnStep).
      if (!w.waiting_step || s.iteration() != w.iteration || s.epoch() != w.epoch) return false;
      w.stepped = true;
      w.waiting_step = false;
      steps_.emplace_back(w.id, s.iteration(), s.squared_norm());
      w.checksum = w.checksum * 31 + s.iteration() + 1;
      v1::IterationResult* r = reply(w.id).mutable_result();
      r->set_job_id(s.job_id());
      r->set_iteration(s.iteration());
      r->set_stage(static_cast<uint32_t>(w.stage));
      r->set_epoch(s.epoch());
      r->set_parameter_checksum(w.checksum);
      if (w.stage == 0) {
        for (const auto& [mb, route] : w.routes) {
          if (route.data_node() == w.id) r->add_microbatches(mb);
        }
        r->set_loss_sum(2.5 * r->microbatches_size());
        r->set_tokens(100u * r->microbatches_size());
      }
      if (checkpoint_ && w.stage < static_cast<int>(w.first_of_stage.size()) &&
          w.first_of_stage[w.stage] == w.id) {
        v1::CheckpointFile* f = r->mutable_checkpoint();
        f->set_stage(static_cast<uint32_t>(w.stage));
        f->set_file(absl::StrCat("stage-", w.stage, ".bin"));
      }
      if (transfer_seconds_ > 0) {
        v1::TimingReport* t = reply(w.id).mutable_timing();
        t->set_job_id(s.job_id());
        t->set_iteration(s.iteration());
        t->set_node(w.id);
        for (const auto& [mb, route] : w.routes) {
          for (int i = 0; i + 1 < route.nodes_size(); ++i) {
            if (route.nodes(i) != w.id) continue;
            v1::TransferTiming* x = t->add_transfers();
            x->set_peer(route.nodes(i + 1));
            x->set_forward(true);
            auto link = links_.find({w.id, route.nodes(i + 1)});
            const double rtt = link != links_.end() ? link->second.rtt : FakeLink().rtt;
            x->set_duration_s(transfer_seconds_ + (transfer_plus_round_trip_ ? rtt : 0));
          }
        }
      }
      return false;
    }
    case v1::CoordinatorMessage::kCommit: {
      WriteManifest(m.commit());
      v1::CheckpointCommitted* c = reply(w.id).mutable_checkpoint_committed();
      c->set_job_id(m.commit().job_id());
      c->set_iteration(m.commit().iteration());
      c->set_dir(m.commit().dir());
      return false;
    }
    case v1::CoordinatorMessage::kProbe: {
      const v1::LinkProbe& p = m.probe();
      probes_.push_back(p);
      probed_by_.push_back(w.id);
      probed_after_.push_back(planned_iterations_.empty() ? 0 : planned_iterations_.back());
      if (w.probes_silent_after && !planned_iterations_.empty() &&
          planned_iterations_.back() >= *w.probes_silent_after) {
        return false;
      }
      v1::LinkReport* r = reply(w.id).mutable_link_report();
      r->set_job_id(p.job_id());
      r->set_round(p.round());
      for (const v1::Peer& peer : p.peers()) {
        if (peer.worker_id() == w.id) continue;
        auto it = links_.find({w.id, peer.worker_id()});
        FakeLink link = it != links_.end() ? it->second : FakeLink();
        auto later = later_links_.find({w.id, peer.worker_id()});
        if (later != later_links_.end() && p.round() >= later->second.first) {
          link = later->second.second;
        }
        v1::LinkMeasurement* l = r->add_links();
        l->set_peer(peer.worker_id());
        if (!link.error.empty()) {
          l->set_error(link.error);
          continue;
        }
        l->set_rtt_seconds(link.rtt);
        if (p.bulk_max_bytes() > 0) l->set_bandwidth_bytes_per_s(link.rate);
      }
      return false;
    }
    case v1::CoordinatorMessage::kAbort:
      w.routes.clear();
      w.waiting_step = false;
      return false;
    case v1::CoordinatorMessage::kCancel:
      w.stage = -1;
      w.routes.clear();
      return false;
    default: return false;
  }
}

void FakeCluster::WriteManifest(const v1::CommitCheckpoint& commit) {
  model::CheckpointManifest manifest;
  manifest.iteration = commit.iteration();
  auto config = model::ModelConfigFromShape(spec_.model());
  ASSERT_TRUE(config.ok()) << config.status();
  manifest.model = *config;
  manifest.num_stages = static_cast<int>(spec_.pipeline().num_stages());
  std::error_code ec;
  std::filesystem::create_directories(commit.dir(), ec);
  ASSERT_TRUE(model::WriteManifest(commit.dir(), manifest).ok());
}

void FakeCluster::Norm(const FakeWorker& w, v1::WorkerMessage& out) {
  v1::GradientNorm* n = out.mutable_grad_norm();
  n->set_job_id(w.job_id);
  n->set_iteration(w.iteration);
  n->set_stage(static_cast<uint32_t>(w.stage));
  n->set_squared_norm(1.0);
  n->set_epoch(w.epoch);
}

}  // namespace detour::testing
