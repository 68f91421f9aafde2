// K-FAC: the math against brute-force references, the optimiser on a real
// Stage, and the engine with OPTIMIZER_KFAC.
#include "worker/model/kfac.h"

#include <cmath>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include "common/kfac_workload.h"
#include "model_test_util.h"
#include "worker/model/corpus.h"
#include "worker/model/engine.h"
#include "worker/model/kfac_inverse.h"
#include "worker/model/routes.h"
#include "worker/model/text_data.h"
#include "worker/model/transformer.h"

namespace detour::model {
namespace {

using testing::MaxAbsDiff;
using testing::SmallSpec;

at::TensorOptions F64() { return at::TensorOptions().dtype(at::kDouble); }

at::Tensor RandomSpd(int64_t n, uint64_t seed) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  at::Tensor x = at::randn({3 * n, n}, gen, F64());
  return at::matmul(x.t(), x) / (3.0 * n);
}

class KfacMathTest : public ::testing::Test {
 protected:
  void SetUp() override { at::set_num_threads(1); }
};

// One sample: the exact Fisher block of W (row-major vec) is kron(B, A), the
// bias block is B.
TEST_F(KfacMathTest, SingleSampleFisherIsKronOfFactors) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(3);
  at::Tensor w = at::randn({3, 4}, gen, F64()).requires_grad_(true);
  at::Tensor bias = at::randn({3}, gen, F64()).requires_grad_(true);
  at::Tensor a = at::randn({4}, gen, F64());
  at::Tensor y = at::matmul(w, a) + bias;
  at::Tensor y_leaf = y.detach().requires_grad_(true);
  at::Tensor loss = at::sin(y_leaf).sum() + y_leaf.pow(2).sum();
  torch::autograd::backward({loss});
  at::Tensor g = y_leaf.grad();
  torch::autograd::backward({y}, {g});
  at::Tensor vec_w = w.grad().reshape({-1});
  at::Tensor fisher_w = at::outer(vec_w, vec_w);
  at::Tensor fisher_b = at::outer(bias.grad(), bias.grad());

  auto f = KfacFactorsForLinear(a.view({1, 4}), g.view({1, 3}));
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_LT(MaxAbsDiff(at::kron(f->b, f->a), fisher_w), 1e-12);
  EXPECT_LT(MaxAbsDiff(f->b, fisher_b), 1e-12);
  // With N samples the factors are means of outer products.
  at::Tensor as = at::randn({5, 4}, gen, F64());
  at::Tensor gs = at::randn({5, 3}, gen, F64());
  auto f5 = KfacFactorsForLinear(as, gs);
  ASSERT_TRUE(f5.ok());
  EXPECT_LT(MaxAbsDiff(f5->a, at::outer(as[2], as[2]) / 5 + at::outer(as[0], as[0]) / 5 +
                                  at::outer(as[1], as[1]) / 5 + at::outer(as[3], as[3]) / 5 +
                                  at::outer(as[4], as[4]) / 5),
            1e-12);
  EXPECT_FALSE(KfacFactorsForLinear(as, gs.narrow(0, 0, 4)).ok());
}

TEST_F(KfacMathTest, PiDampingSplitsDamping) {
  KfacDamping d = PiDamping(/*tr A*/ 8, 4, /*tr B*/ 2, 2, /*λ*/ 1e-2);
  EXPECT_NEAR(d.pi, std::sqrt(2.0), 1e-12);
  EXPECT_NEAR(d.damping_a, 0.1 * std::sqrt(2.0), 1e-12);
  EXPECT_NEAR(d.damping_b, 0.1 / std::sqrt(2.0), 1e-12);
  for (double tr_a : {0.0, std::nan("")}) {
    KfacDamping z = PiDamping(tr_a, 4, 2, 2, 1e-2);
    EXPECT_EQ(z.pi, 1);
    EXPECT_NEAR(z.damping_a, 0.1, 1e-12);
    EXPECT_NEAR(z.damping_b, 0.1, 1e-12);
  }
  KfacDamping inf = PiDamping(8, 4, 0, 2, 1e-2);  // tr B = 0: π = ∞
  EXPECT_NEAR(inf.damping_a, 0.1, 1e-12);
  KfacDamping floor = PiDamping(1e20, 1, 1, 1, 1e-16);
  EXPECT_GE(floor.damping_b, 1e-7);
}

TEST_F(KfacMathTest, DampedInverseTimesDampedMatrixIsIdentity) {
  at::Tensor a = RandomSpd(6, 1).to(at::kFloat);
  at::Tensor b = RandomSpd(5, 2).to(at::kFloat) * 1e-3;
  KfacDamping d = PiDamping(a.trace().item<double>(), 6, b.trace().item<double>(), 5, 1e-3);
  for (auto [f, lambda] : {std::make_pair(a, d.damping_a), std::make_pair(b, d.damping_b)}) {
    double used = 0;
    auto inv = DampedInverse(f, lambda, &used);
    ASSERT_TRUE(inv.ok()) << inv.status();
    EXPECT_EQ(inv->scalar_type(), at::kFloat);
    EXPECT_EQ(used, lambda);
    const int64_t n = f.size(0);
    at::Tensor damped = f + at::eye(n, f.options()) * lambda;
    EXPECT_LT(MaxAbsDiff(at::matmul(damped, *inv), at::eye(n, f.options())), 1e-4);
  }
}

TEST_F(KfacMathTest, SingularFactorsFallBackWithoutNaN) {
  // Zero factor: π falls back, the inverse is I / sqrt(λ).
  at::Tensor zero = at::zeros({4, 4});
  KfacDamping d = PiDamping(0, 4, 3, 3, 1e-4);
  auto inv = DampedInverse(zero, d.damping_a);
  ASSERT_TRUE(inv.ok()) << inv.status();
  EXPECT_LT(MaxAbsDiff(*inv, at::eye(4) * 100.0), 1e-3);
  // Rank 1 with the floor damping: finite (fp32, else fp64, else more damping).
  at::Tensor v = at::arange(1, 9, at::TensorOptions().dtype(at::kFloat)) * 100;
  auto inv1 = DampedInverse(at::outer(v, v), 1e-12);
  ASSERT_TRUE(inv1.ok()) << inv1.status();
  EXPECT_TRUE(at::isfinite(*inv1).all().item<bool>());
  // Indefinite: only more damping helps; reported.
  double used = 0;
  auto inv2 = DampedInverse(-at::eye(3), 1e-3, &used);
  ASSERT_TRUE(inv2.ok()) << inv2.status();
  EXPECT_NEAR(used, 10.0, 1e-9);
  EXPECT_LT(MaxAbsDiff(*inv2, at::eye(3) / 9.0), 1e-6);
  // Non-finite: an error, not NaNs.
  at::Tensor bad = at::eye(3);
  bad[1][1] = NAN;
  EXPECT_EQ(DampedInverse(bad, 1e-3).status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST_F(KfacMathTest, PreconditionedGradientEqualsDenseSolve) {
  at::Tensor a = RandomSpd(4, 5);
  at::Tensor b = RandomSpd(3, 6);
  KfacDamping d = PiDamping(a.trace().item<double>(), 4, b.trace().item<double>(), 3, 1e-2);
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(7);
  at::Tensor grad = at::randn({3, 4}, gen, F64());
  auto a_inv = DampedInverse(a, d.damping_a);
  auto b_inv = DampedInverse(b, d.damping_b);
  ASSERT_TRUE(a_inv.ok() && b_inv.ok());
  auto delta = KfacPreconditionedGradient(grad, *a_inv, *b_inv);
  ASSERT_TRUE(delta.ok()) << delta.status();
  at::Tensor dense =
      at::kron(b + at::eye(3, F64()) * d.damping_b, a + at::eye(4, F64()) * d.damping_a);
  at::Tensor ref = at::linalg_solve(dense, grad.reshape({12, 1})).reshape({3, 4});
  EXPECT_LT(MaxAbsDiff(*delta, ref), 1e-10);
  EXPECT_FALSE(KfacPreconditionedGradient(grad.t(), *a_inv, *b_inv).ok());
}

// Known answer: one linear layer y = W·a with the per-token loss
// ½‖y - t‖² (a Gaussian likelihood, whose Fisher is A ⊗ I). B from targets
// SAMPLED from the model (t ~ N(y, I): the true Fisher's output factor) with
// the engine's normalisation — the batch loss is the mean over N tokens and
// B rescales the output gradient by N — is ≈ I, and one K-FAC step with lr 1
// and tiny damping is a Newton step: W - ΔW is the least-squares solution.
// Checks the sign, the N scaling of B, and that ∇W is the mean gradient.
TEST_F(KfacMathTest, NaturalGradientStepSolvesLinearRegression) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(21);
  const int64_t n = 20000, f_in = 5, f_out = 3;
  at::Tensor a = at::randn({n, f_in}, gen, F64()) * at::linspace(0.3, 3, f_in, F64());
  at::Tensor w_true = at::randn({f_out, f_in}, gen, F64());
  at::Tensor t_data = at::matmul(a, w_true.t()) + at::randn({n, f_out}, gen, F64()) * 0.1;
  at::Tensor w = at::randn({f_out, f_in}, gen, F64());
  auto mean_loss = [&](const at::Tensor& w_, const at::Tensor& t) {
    return (at::matmul(a, w_.t()) - t).pow(2).sum(1).mul(0.5).mean();
  };
  // Curvature with sampled targets: output gradient of the MEAN loss, ×N.
  at::Tensor y = at::matmul(a, w.t()).detach().requires_grad_(true);
  at::Tensor t_model = y.detach() + at::randn({n, f_out}, gen, F64());
  torch::autograd::backward({(y - t_model).pow(2).sum(1).mul(0.5).mean()});
  auto f = KfacFactorsForLinear(a, y.grad() * static_cast<double>(n));
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_LT(MaxAbsDiff(f->b, at::eye(f_out, F64())), 0.05);  // per-token units
  // Mean gradient on the data.
  at::Tensor wl = w.clone().requires_grad_(true);
  torch::autograd::backward({mean_loss(wl, t_data)});
  KfacDamping d =
      PiDamping(f->a.trace().item<double>(), f_in, f->b.trace().item<double>(), f_out, 1e-8);
  auto a_inv = DampedInverse(f->a, d.damping_a);
  auto b_inv = DampedInverse(f->b, d.damping_b);
  ASSERT_TRUE(a_inv.ok() && b_inv.ok());
  auto delta = KfacPreconditionedGradient(wl.grad(), *a_inv, *b_inv);
  ASSERT_TRUE(delta.ok());
  // Least squares: W_ls = (Tᵀ a)(aᵀ a)⁻¹.
  at::Tensor w_ls = at::linalg_solve(at::matmul(a.t(), a), at::matmul(a.t(), t_data)).t();
  const double l0 = mean_loss(w, t_data).item<double>();
  const double l_ls = mean_loss(w_ls, t_data).item<double>();
  const double l1 = mean_loss(w - *delta, t_data).item<double>();
  EXPECT_GT(l0, 10 * l_ls);
  // B is I up to Monte-Carlo error (~1/√N): the step lands within a few %
  // of the way from W to the optimum.
  EXPECT_LT(l1 - l_ls, 0.01 * (l0 - l_ls));
  EXPECT_LT(MaxAbsDiff(w - *delta, w_ls), 0.1);
}

// ---- Kfac on a real Stage --------------------------------------------------

v1::JobSpec TwoStageSpec() {
  v1::JobSpec spec = SmallSpec();
  spec.mutable_pipeline()->set_num_stages(2);  // 4 blocks: stage 1 holds 2, 3
  spec.mutable_optimizer()->set_kind(v1::OPTIMIZER_KFAC);
  return spec;
}

class KfacStageTest : public ::testing::Test {
 protected:
  void SetUp() override {
    at::set_num_threads(1);
    spec_ = TwoStageSpec();
    auto stage = Stage::FromJobSpec(spec_, 1, at::Device(at::kCPU));
    ASSERT_TRUE(stage.ok()) << stage.status();
    stage_ = std::move(*stage);
    at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(11);
    x_ = at::randn({2, 8, 32}, gen);
    grad_out_ = at::randn({2, 8, 32}, gen) * 1e-2;
  }

  std::unique_ptr<Kfac> MakeKfac(const v1::OptimizerSpec& o) {
    auto k = Kfac::Create(stage_.get(), o);
    EXPECT_TRUE(k.ok()) << k.status();
    return k.ok() ? std::move(*k) : nullptr;
  }

  // Forward + backward of microbatch mb through stage 1.
  void RunMicrobatch(uint32_t mb, const at::Tensor& x, const at::Tensor& g) {
    ASSERT_TRUE(stage_->Forward(mb, x).ok());
    ASSERT_TRUE(stage_->Backward(mb, g).ok());
  }

  v1::JobSpec spec_;
  std::unique_ptr<Stage> stage_;
  at::Tensor x_, grad_out_;
};

TEST_F(KfacStageTest, CurvatureErrorsAndNormalisation) {
  auto kfac = MakeKfac(spec_.optimizer());
  ASSERT_NE(kfac, nullptr);
  EXPECT_EQ(kfac->PendingFactorTensors(2).size(), 13u);
  EXPECT_TRUE(kfac->PendingFactorTensors(0).empty());
  EXPECT_EQ(kfac->InvertA(2, "q").code(), absl::StatusCode::kFailedPrecondition);

  kfac->Capture(0);
  EXPECT_TRUE(kfac->captured(0));
  EXPECT_FALSE(kfac->captured(1));
  absl::Status early = kfac->CurvatureA(2, 0);
  EXPECT_EQ(early.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(early.message().find("forward"), std::string::npos) << early;
  ASSERT_TRUE(stage_->Forward(0, x_).ok());
  ASSERT_TRUE(kfac->CurvatureA(2, 0).ok());
  absl::Status no_back = kfac->CurvatureB(2, 0);
  EXPECT_EQ(no_back.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(no_back.message().find("backward"), std::string::npos) << no_back;
  ASSERT_TRUE(stage_->Backward(0, grad_out_).ok());
  ASSERT_TRUE(kfac->CurvatureB(3, 0).ok());
  absl::Status again = kfac->CurvatureA(2, 0);
  EXPECT_EQ(again.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(again.message().find("already consumed"), std::string::npos) << again;
  absl::Status not_captured = kfac->CurvatureA(2, 5);
  EXPECT_EQ(not_captured.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(not_captured.message().find("layer 2 mb 5"), std::string::npos) << not_captured;
  EXPECT_EQ(kfac->CurvatureA(0, 0).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(kfac->CurvatureB(7, 0).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(kfac->InvertA(2, "nope").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(kfac->InvertA(0, "q").code(), absl::StatusCode::kInvalidArgument);

  // Pending sums: A of layer 2's q/k/v input = Σ n nᵀ with n = RMSNorm(x)
  // (norm weight 1); B of layer 3's "down" = N² Σ g gᵀ since g_down is the
  // gradient given to the stage (the residual's last branch), N = 16 tokens.
  std::vector<at::Tensor> p2 = kfac->PendingFactorTensors(2);
  std::vector<at::Tensor> p3 = kfac->PendingFactorTensors(3);
  at::Tensor n = RmsNorm(x_, at::ones({32}), spec_.model().norm_eps()).reshape({16, 32});
  EXPECT_LT(MaxAbsDiff(p2[0], at::matmul(n.t(), n)), 1e-4);
  EXPECT_EQ(p2[11].item<double>(), 16);
  EXPECT_EQ(p2[12].item<double>(), 0);  // layer 2's B not taken yet
  at::Tensor g = grad_out_.reshape({16, 32});
  EXPECT_LT(MaxAbsDiff(p3[4 + 6], at::matmul(g.t(), g) * 256.0), 1e-4);
  EXPECT_EQ(p3[12].item<double>(), 16);

  // Finalised: F = sum / count; B of layer 3's down is the per-token Fisher.
  ASSERT_TRUE(kfac->InvertB(3, "down").ok());
  EXPECT_LT(MaxAbsDiff(kfac->FactorB(3, "down"), at::matmul(g.t(), g) * 16.0), 1e-4);
  for (const at::Tensor& t : kfac->PendingFactorTensors(3)) {
    EXPECT_EQ(t.abs().sum().item<double>(), 0);  // cleared
  }
  kfac->DropCapture(0);
  EXPECT_FALSE(kfac->captured(0));
  EXPECT_EQ(kfac->CurvatureB(2, 0).code(), absl::StatusCode::kFailedPrecondition);
}

// π comes from one snapshot: inverting all A first or all B first gives the
// same π, damping and inverses, equal to PiDamping of the running factors.
TEST_F(KfacStageTest, InversionOrderDoesNotChangePi) {
  auto first = MakeKfac(spec_.optimizer());
  auto second = MakeKfac(spec_.optimizer());
  first->Capture(0);
  RunMicrobatch(0, x_, grad_out_);
  second->Capture(1);
  RunMicrobatch(1, x_, grad_out_);
  for (int layer : {2, 3}) {
    ASSERT_TRUE(first->CurvatureA(layer, 0).ok());
    ASSERT_TRUE(first->CurvatureB(layer, 0).ok());
    ASSERT_TRUE(second->CurvatureA(layer, 1).ok());
    ASSERT_TRUE(second->CurvatureB(layer, 1).ok());
  }
  for (const std::string& m : KfacModules()) ASSERT_TRUE(first->InvertA(2, m).ok());
  for (const std::string& m : KfacModules()) ASSERT_TRUE(first->InvertB(2, m).ok());
  for (const std::string& m : KfacModules()) ASSERT_TRUE(second->InvertB(2, m).ok());
  for (const std::string& m : KfacModules()) ASSERT_TRUE(second->InvertA(2, m).ok());
  EXPECT_FALSE(first->has_inverses(2));  // staged until Activate
  first->Activate();
  second->Activate();
  EXPECT_TRUE(first->has_inverses(2));
  EXPECT_FALSE(first->has_inverses(3));
  for (const std::string& m : KfacModules()) {
    auto d1 = first->Damping(2, m);
    auto d2 = second->Damping(2, m);
    ASSERT_TRUE(d1.ok() && d2.ok());
    at::Tensor a = first->FactorA(2, m);
    at::Tensor b = first->FactorB(2, m);
    KfacDamping want = PiDamping(a.trace().item<double>(), a.size(0), b.trace().item<double>(),
                                 b.size(0), spec_.optimizer().kfac().damping());
    EXPECT_NEAR(d1->pi, want.pi, 1e-6 * want.pi) << m;
    EXPECT_NEAR(d2->pi, want.pi, 1e-6 * want.pi) << m;
    EXPECT_NE(d1->pi, 1.0) << m;
    EXPECT_LT(MaxAbsDiff(first->InverseA(2, m), second->InverseA(2, m)), 1e-6);
    EXPECT_LT(MaxAbsDiff(first->InverseB(2, m), second->InverseB(2, m)), 1e-3);
    // The active inverse inverts the π-damped factor.
    at::Tensor damped = a + at::eye(a.size(0)) * d1->damping_a;
    EXPECT_LT(MaxAbsDiff(at::matmul(damped, first->InverseA(2, m)), at::eye(a.size(0))), 1e-3);
  }
  // q, k, v share A but not π (their B differ).
  EXPECT_TRUE(at::equal(first->FactorA(2, "q"), first->FactorA(2, "k")));
  EXPECT_NE(first->Damping(2, "q")->pi, first->Damping(2, "k")->pi);
}

TEST_F(KfacStageTest, RunningAverageOfFactors) {
  v1::OptimizerSpec o = spec_.optimizer();
  o.mutable_kfac()->set_factor_decay(0.25);
  auto avg = MakeKfac(o);
  auto fresh = MakeKfac(spec_.optimizer());
  at::Tensor x2 = x_ * 2 + 0.5;
  avg->Capture(0);
  RunMicrobatch(0, x_, grad_out_);
  ASSERT_TRUE(avg->RefreshSerially().ok());
  at::Tensor first_a = avg->FactorA(3, "up").clone();
  at::Tensor first_b = avg->FactorB(3, "up").clone();
  avg->Capture(1);
  RunMicrobatch(1, x2, grad_out_ * 3);
  ASSERT_TRUE(avg->RefreshSerially().ok());
  fresh->Capture(2);
  RunMicrobatch(2, x2, grad_out_ * 3);
  ASSERT_TRUE(fresh->RefreshSerially().ok());
  EXPECT_LT(MaxAbsDiff(avg->FactorA(3, "up"), first_a * 0.75 + fresh->FactorA(3, "up") * 0.25),
            1e-4);
  EXPECT_LT(MaxAbsDiff(avg->FactorB(3, "up"), first_b * 0.75 + fresh->FactorB(3, "up") * 0.25),
            1e-5);
}

// Precondition: ΔW = B⁻¹∇W A⁻¹ applied with lr_kfac = kfac.lr × lr/adamw.lr;
// AdamW keeps the norms; KL clipping scales the update.
TEST_F(KfacStageTest, PreconditionUpdatesProjections) {
  v1::OptimizerSpec o = spec_.optimizer();
  o.mutable_adamw()->set_lr(1e-3);
  o.mutable_adamw()->set_weight_decay(0);
  o.mutable_kfac()->set_lr(2e-2);
  o.mutable_kfac()->set_momentum(0);
  o.mutable_kfac()->set_kl_clip(-1);
  o.mutable_kfac()->set_update(v1::KFAC_UPDATE_MOMENTUM);
  auto kfac = MakeKfac(o);
  AdamW adam(stage_->Parameters(), o.adamw());
  adam.set_precondition_hook(kfac.get());

  // No inverses yet: everything is AdamW's, gradients untouched.
  RunMicrobatch(0, x_, grad_out_);
  std::map<std::string, at::Tensor> before, grads;
  for (auto& [name, p] : stage_->Parameters()) {
    before[name] = p.detach().clone();
    grads[name] = p.grad().clone();
  }
  ASSERT_TRUE(adam.Step(5e-4).ok());
  for (auto& [name, p] : stage_->Parameters()) {
    EXPECT_TRUE(at::equal(p.grad(), grads[name])) << name;
  }
  stage_->ZeroGrad();

  kfac->Capture(1);
  RunMicrobatch(1, x_, grad_out_);
  ASSERT_TRUE(kfac->RefreshSerially().ok());
  ASSERT_TRUE(kfac->has_inverses(2) && kfac->has_inverses(3));
  for (auto& [name, p] : stage_->Parameters()) {
    before[name] = p.detach().clone();
    grads[name] = p.grad().clone();
  }
  const double lr = 5e-4;  // half the peak: lr_kfac = 1e-2
  ASSERT_TRUE(adam.Step(lr).ok());
  std::map<std::string, at::Tensor> after = testing::ToMap(stage_->Parameters());
  const std::string q = "layers.2.wq";
  at::Tensor want =
      at::matmul(at::matmul(kfac->InverseB(2, "q"), grads[q]), kfac->InverseA(2, "q"));
  EXPECT_LT(MaxAbsDiff(after[q].grad(), want), 1e-6);
  EXPECT_LT(MaxAbsDiff(after[q].detach(), before[q] - want * 1e-2), 1e-7);
  EXPECT_GT(MaxAbsDiff(want, grads[q]), 1e-3);  // really preconditioned
  for (auto& [name, p] : after) {
    EXPECT_TRUE(at::isfinite(p.detach()).all().item<bool>()) << name;
    EXPECT_FALSE(at::equal(p.detach(), before[name])) << name;  // all stepped
  }
  EXPECT_EQ(kfac->last_kl_scale(), 1);

  // KL clipping on: ν = sqrt(kl_clip / (lr_kfac² Σ⟨ΔW, ∇W⟩)) < 1.
  o.mutable_kfac()->set_kl_clip(1e-12);
  auto clipped = MakeKfac(o);
  clipped->Capture(2);
  stage_->ZeroGrad();
  RunMicrobatch(2, x_, grad_out_);
  ASSERT_TRUE(clipped->RefreshSerially().ok());
  ASSERT_TRUE(clipped->BeginStep(lr).ok());
  EXPECT_GT(clipped->last_kl_scale(), 0);
  EXPECT_LT(clipped->last_kl_scale(), 1);
}

// Grafting (the default update): each projection moves along B⁻¹·m̂·A⁻¹
// by exactly lr_kfac × the norm of the AdamW update it replaces (first step:
// m̂ = g, v̂ = g², U = g/(|g| + eps)); AdamW does not also update it.
TEST_F(KfacStageTest, GraftingTakesAdamWsStepLength) {
  v1::OptimizerSpec o = spec_.optimizer();
  o.mutable_adamw()->set_lr(1e-3);
  o.mutable_adamw()->set_weight_decay(0);
  o.mutable_adamw()->set_beta1(0.9);
  o.mutable_adamw()->set_beta2(0.95);
  o.mutable_adamw()->set_eps(1e-8);
  o.mutable_kfac()->set_lr(1e-3);
  o.mutable_kfac()->set_update(v1::KFAC_UPDATE_GRAFT_ADAMW);
  auto kfac = MakeKfac(o);
  AdamW adam(stage_->Parameters(), o.adamw());
  adam.set_precondition_hook(kfac.get());
  kfac->Capture(0);
  RunMicrobatch(0, x_, grad_out_);
  ASSERT_TRUE(kfac->RefreshSerially().ok());
  std::map<std::string, at::Tensor> before, grads;
  for (auto& [name, p] : stage_->Parameters()) {
    before[name] = p.detach().clone();
    grads[name] = p.grad().clone();
  }
  const double lr = 5e-4;
  ASSERT_TRUE(adam.Step(lr).ok());
  std::map<std::string, at::Tensor> after = testing::ToMap(stage_->Parameters());
  for (const char* q : {"layers.2.wq", "layers.3.w_down"}) {
    const at::Tensor& g = grads[q];
    const int layer = q[7] - '0';
    const std::string module = std::string(q).find("down") != std::string::npos ? "down" : "q";
    at::Tensor dir =
        at::matmul(at::matmul(kfac->InverseB(layer, module), g), kfac->InverseA(layer, module));
    at::Tensor adam_update = g / (g.abs() + 1e-8);
    at::Tensor step = (before[q] - after[q].detach()) / lr;
    EXPECT_NEAR(step.norm().item<double>(), adam_update.norm().item<double>(),
                1e-3 * adam_update.norm().item<double>())
        << q;
    const double cosine =
        (step * dir).sum().item<double>() / (step.norm() * dir.norm()).item<double>();
    EXPECT_GT(cosine, 1 - 1e-4) << q;
    EXPECT_NEAR(kfac->last_graft_scale(layer, module),
                adam_update.norm().item<double>() / dir.norm().item<double>(),
                1e-3 * kfac->last_graft_scale(layer, module))
        << q;
    EXPECT_GT(MaxAbsDiff(step / step.norm(), adam_update / adam_update.norm()), 1e-2)
        << q;  // a different direction from AdamW's
  }
  for (auto& [name, p] : after) {
    EXPECT_TRUE(at::isfinite(p.detach()).all().item<bool>()) << name;
  }
}

// ---- Replicas preconditioning their own gradients ------------------------------

// Two replicas of stage 1, the runtime's steps by hand: each preconditions its
// own summed gradient with its own factors, the payloads (plus votes) are
// summed in rank order, the sum is the gradient, then the step.
// ---- Granules: an item in parts equals it whole, bit for bit. -----------

// A well-conditioned symmetric positive definite fp32 factor.
at::Tensor RandomFactor(int64_t n, uint64_t seed) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  at::Tensor q = at::randn({n, n}, gen);
  return at::matmul(q, q.t()) / static_cast<double>(n) + at::eye(n) * 0.5;
}

TEST_F(KfacMathTest, InversionInPartsEqualsWholeBitForBit) {
  // Unblocked (two units: potrf, potri) and blocked (5 blocks: 10 units).
  for (int64_t n : {96, 1030}) {
    SCOPED_TRACE(n);
    const at::Tensor f = RandomFactor(n, 10 + n);
    const double damping = 1e-3;
    auto whole = DampedInverse(f, damping);
    ASSERT_TRUE(whole.ok()) << whole.status();
    // Against LAPACK's inverse of the same damped matrix in fp64.
    at::Tensor f64 = f.to(at::kDouble);
    at::Tensor m = (f64 + f64.t()) * 0.5 + at::eye(n, F64()) * damping;
    at::Tensor ref = at::cholesky_inverse(at::linalg_cholesky(m));
    EXPECT_LT(MaxAbsDiff(whole->to(at::kDouble), ref) / ref.abs().max().item<double>(), 1e-4);
    if (n <= kfac::kUnblockedInversion) {
      // Unblocked it is exactly what DampedInverse always computed.
      at::Tensor m32 = (f + f.t()) * 0.5 + at::eye(n, f.options()) * damping;
      EXPECT_TRUE(at::equal(*whole, at::cholesky_inverse(at::linalg_cholesky(m32))));
    }
    const std::vector<int64_t> units = kfac::InversionUnitWeights(n);
    EXPECT_EQ(units.size(), n <= kfac::kUnblockedInversion ? 2u : 10u);
    for (int parts : {1, 2, static_cast<int>(units.size())}) {
      auto work = DampedInverseWork::Start(f, damping);
      ASSERT_TRUE(work.ok()) << work.status();
      const std::vector<int> bounds = kfac::SplitIntoParts(units, parts);
      for (int p = 0; p < parts; ++p) {
        ASSERT_TRUE((*work)->RunUntil(bounds[p + 1]).ok());
        EXPECT_EQ((*work)->units_done(), bounds[p + 1]);
        EXPECT_EQ((*work)->done(), p == parts - 1);
      }
      EXPECT_TRUE(at::equal((*work)->result(), *whole)) << parts << " parts";
    }
  }
}

TEST_F(KfacMathTest, InversionFallbackInPartsEqualsWhole) {
  // Blocked, 5 blocks of 206 rows: positive on the first 600 diagonal
  // entries, negative after. fp32 and fp64 fail in the third Cholesky step
  // (rows 412-617) until the damping reaches 10; that part runs the rest.
  const int64_t n = 1030;
  at::Tensor f = at::ones({n});
  f.narrow(0, 600, n - 600).fill_(-1);
  f = at::diag(f);
  double used = 0;
  auto whole = DampedInverse(f, 1e-3, &used);
  ASSERT_TRUE(whole.ok()) << whole.status();
  EXPECT_NEAR(used, 10, 1e-9);
  at::Tensor want = at::ones({n}) / 11.0;
  want.narrow(0, 600, n - 600).fill_(1.0 / 9.0);
  EXPECT_LT(MaxAbsDiff(*whole, at::diag(want)), 1e-6);
  const std::vector<int64_t> units = kfac::InversionUnitWeights(n);
  for (int parts : {2, static_cast<int>(units.size())}) {
    auto work = DampedInverseWork::Start(f, 1e-3);
    ASSERT_TRUE(work.ok());
    const std::vector<int> bounds = kfac::SplitIntoParts(units, parts);
    for (int p = 0; p < parts; ++p) ASSERT_TRUE((*work)->RunUntil(bounds[p + 1]).ok());
    ASSERT_TRUE((*work)->done());
    EXPECT_TRUE(at::equal((*work)->result(), *whole)) << parts << " parts";
    EXPECT_EQ((*work)->used_damping(), used);
  }
  // Nothing helps a non-finite factor: refused at the start.
  at::Tensor bad = at::eye(4);
  bad[2][2] = INFINITY;
  EXPECT_EQ(DampedInverseWork::Start(bad, 1e-3).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(DampedInverseWork::Start(at::ones({2, 3}), 1e-3).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(KfacStageTest, PartsEqualWholeItemsBitForBit) {
  auto whole = MakeKfac(spec_.optimizer());
  auto split = MakeKfac(spec_.optimizer());
  ASSERT_NE(whole, nullptr);
  ASSERT_NE(split, nullptr);
  whole->Capture(0);
  RunMicrobatch(0, x_, grad_out_);
  split->Capture(1);
  RunMicrobatch(1, x_, grad_out_);  // the same data: the same saved tensors
  for (int layer : {2, 3}) {
    ASSERT_TRUE(whole->CurvatureA(layer, 0).ok());
    ASSERT_TRUE(whole->CurvatureB(layer, 0).ok());
    // Any order of the parts; A per input (4), B in 3 runs of projections.
    for (int part : {3, 1, 0, 2}) ASSERT_TRUE(split->CurvatureA(layer, 1, part, 4).ok());
    for (int part : {2, 0, 1}) ASSERT_TRUE(split->CurvatureB(layer, 1, part, 3).ok());
    const std::vector<at::Tensor> a = whole->PendingFactorTensors(layer);
    const std::vector<at::Tensor> b = split->PendingFactorTensors(layer);
    ASSERT_EQ(a.size(), b.size());
    for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(at::equal(a[i], b[i])) << layer << " " << i;
  }
  absl::Status again = split->CurvatureA(2, 1, 0, 4);
  EXPECT_EQ(again.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(again.message().find("already consumed"), std::string::npos) << again;
  EXPECT_EQ(split->CurvatureA(2, 1, 4, 4).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(split->CurvatureB(2, 1, 0, 8).code(), absl::StatusCode::kInvalidArgument);
  // A part taken twice within a microbatch is refused too (layer 3: the
  // inversions below compare layer 2).
  split->Capture(2);
  RunMicrobatch(2, x_, grad_out_);
  ASSERT_TRUE(split->CurvatureB(3, 2, 1, 7).ok());
  EXPECT_EQ(split->CurvatureB(3, 2, 1, 7).code(), absl::StatusCode::kFailedPrecondition);
  split->DropCapture(2);

  // Every factor here is at most kUnblockedInversion wide: 2 units.
  for (const std::string& m : KfacModules()) {
    ASSERT_TRUE(whole->InvertA(2, m).ok());
    ASSERT_TRUE(whole->InvertB(2, m).ok());
    ASSERT_TRUE(split->InvertA(2, m, 0, 2).ok());
    ASSERT_TRUE(split->InvertA(2, m, 1, 2).ok());
    // B: the last part alone (a restart lost the first) runs what is missing.
    ASSERT_TRUE(split->InvertB(2, m, 1, 2).ok());
  }
  EXPECT_EQ(split->InvertA(2, "q", 2, 2).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(split->InvertA(2, "q", 0, 3).code(), absl::StatusCode::kInvalidArgument);
  whole->Activate();
  split->Activate();
  for (const std::string& m : KfacModules()) {
    EXPECT_TRUE(at::equal(whole->InverseA(2, m), split->InverseA(2, m))) << m;
    EXPECT_TRUE(at::equal(whole->InverseB(2, m), split->InverseB(2, m))) << m;
  }
}

// Overlapping refreshes on one worker: the next refresh's curvature taken
// between this refresh's inversions stays out of them, the next refresh
// may invert before this one is activated, and each activation takes its
// own refresh's inverses (also after a round trip through State()).
TEST_F(KfacStageTest, OverlappingRefreshesStayApart) {
  auto kfac = MakeKfac(spec_.optimizer());  // factor_decay 1: F = the newest
  auto only0 = MakeKfac(spec_.optimizer());
  auto only1 = MakeKfac(spec_.optimizer());
  const at::Tensor x2 = x_ * 2 + 0.5, g2 = grad_out_ * 3;
  auto curvature = [&](Kfac* k, uint32_t mb, const at::Tensor& x, const at::Tensor& g) {
    k->Capture(mb);
    RunMicrobatch(mb, x, g);
    ASSERT_TRUE(k->CurvatureA(2, mb).ok());
    ASSERT_TRUE(k->CurvatureB(2, mb).ok());
  };
  curvature(kfac.get(), 0, x_, grad_out_);
  ASSERT_TRUE(kfac->InvertA(2, "q", 0, 1, /*refresh=*/0).ok());  // finalises refresh 0
  curvature(kfac.get(), 1, x2, g2);                              // refresh 1's
  ASSERT_TRUE(kfac->InvertA(2, "k", 0, 1, 0).ok());              // still refresh 0's factors
  ASSERT_TRUE(kfac->InvertA(2, "q", 0, 1, 1).ok());              // refresh 1 finalises mb 1
  curvature(only0.get(), 2, x_, grad_out_);
  curvature(only1.get(), 3, x2, g2);
  for (Kfac* k : {only0.get(), only1.get()}) {
    ASSERT_TRUE(k->InvertA(2, "q").ok());
    ASSERT_TRUE(k->InvertA(2, "k").ok());
    k->Activate();
  }
  std::map<std::string, at::Tensor> saved;
  for (const auto& [name, t] : kfac->State()) saved[name] = t;
  kfac->Activate(0);
  EXPECT_TRUE(at::equal(kfac->InverseA(2, "q"), only0->InverseA(2, "q")));
  EXPECT_TRUE(at::equal(kfac->InverseA(2, "k"), only0->InverseA(2, "k")));
  kfac->Activate(1);
  EXPECT_TRUE(at::equal(kfac->InverseA(2, "q"), only1->InverseA(2, "q")));
  EXPECT_TRUE(at::equal(kfac->InverseA(2, "k"), only0->InverseA(2, "k")));  // not inverted in 1
  // The same from the saved state: staged inverses keep their refresh.
  auto copy = MakeKfac(spec_.optimizer());
  ASSERT_TRUE(copy->LoadState(saved).ok());
  copy->Activate(0);
  EXPECT_TRUE(at::equal(copy->InverseA(2, "q"), only0->InverseA(2, "q")));
  copy->Activate(1);
  EXPECT_TRUE(at::equal(copy->InverseA(2, "q"), only1->InverseA(2, "q")));
  // A staged inverse of an abandoned numbering (a coordinator restart) is
  // dropped, not activated.
  auto stale = MakeKfac(spec_.optimizer());
  curvature(stale.get(), 4, x_, grad_out_);
  ASSERT_TRUE(stale->InvertA(2, "q", 0, 1, 5).ok());
  stale->Activate(0);
  EXPECT_FALSE(stale->InverseA(2, "q").defined());
  // The state is relative to the last activation: the same whatever the
  // coordinator's numbering, and a new numbering (a joining replica, a
  // coordinator restart) keeps what is pending in its place.
  auto renumbered = MakeKfac(spec_.optimizer());
  ASSERT_TRUE(renumbered->LoadState(saved).ok());
  renumbered->RebaseRefreshes(9);  // the last activated is 9: 0 and 1 become 10, 11
  auto plain = MakeKfac(spec_.optimizer());
  ASSERT_TRUE(plain->LoadState(saved).ok());
  const std::vector<NamedTensor> a = plain->State(), b = renumbered->State();
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].first, b[i].first);
    EXPECT_TRUE(at::equal(a[i].second, b[i].second)) << a[i].first;
  }
  renumbered->Activate(10);
  EXPECT_TRUE(at::equal(renumbered->InverseA(2, "q"), only0->InverseA(2, "q")));
  // Refresh 11 finalised its factors before the state was saved: its next
  // inversion of the layer does not finalise again.
  ASSERT_TRUE(renumbered->InvertA(2, "k", 0, 1, 11).ok());
  renumbered->Activate(11);
  EXPECT_TRUE(at::equal(renumbered->InverseA(2, "q"), only1->InverseA(2, "q")));
  EXPECT_TRUE(at::equal(renumbered->InverseA(2, "k"), only1->InverseA(2, "k")));
}

class KfacReplicaTest : public ::testing::Test {
 protected:
  void SetUp() override {
    at::set_num_threads(1);
    spec_ = TwoStageSpec();
    spec_.mutable_optimizer()->mutable_kfac()->set_replica_sync(
        v1::KFAC_REPLICA_SYNC_PRECONDITIONED);
    spec_.mutable_optimizer()->mutable_adamw()->set_lr(1e-3);
    spec_.mutable_optimizer()->mutable_kfac()->set_lr(1e-3);
    for (int r = 0; r < 2; ++r) {
      auto stage = Stage::FromJobSpec(spec_, 1, at::Device(at::kCPU));
      ASSERT_TRUE(stage.ok()) << stage.status();
      stages_.push_back(std::move(*stage));
      auto k = Kfac::Create(stages_[r].get(), spec_.optimizer());
      ASSERT_TRUE(k.ok()) << k.status();
      kfacs_.push_back(std::move(*k));
      adams_.push_back(
          std::make_unique<AdamW>(stages_[r]->Parameters(), spec_.optimizer().adamw()));
      adams_[r]->set_precondition_hook(kfacs_[r].get());
    }
  }

  static at::Tensor Flat(Stage& stage) {
    std::vector<at::Tensor> parts;
    for (auto& [name, p] : stage.Parameters()) parts.push_back(p.grad().reshape({-1}).clone());
    return at::cat(parts);
  }
  static void Unflat(Stage& stage, const at::Tensor& flat) {
    int64_t off = 0;
    for (auto& [name, p] : stage.Parameters()) {
      p.mutable_grad().copy_(flat.narrow(0, off, p.numel()).view(p.sizes()));
      off += p.numel();
    }
  }
  static at::Tensor Param(Stage& stage, const std::string& name) {
    for (auto& [n, p] : stage.Parameters()) {
      if (n == name) return p;
    }
    ADD_FAILURE() << "no parameter " << name;
    return at::Tensor();
  }
  static int64_t Numel(Stage& stage) {
    int64_t n = 0;
    for (auto& [name, p] : stage.Parameters()) n += p.numel();
    return n;
  }

  // One iteration; `refresh` computes and activates new inverses on every
  // replica after the step (as a planned activation would). Returns the
  // reduced gradient of layers.2.wq (the mean over 2 visits).
  at::Tensor Iterate(int step, bool refresh) {
    std::vector<at::Tensor> payloads;
    for (int r = 0; r < 2; ++r) {
      at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(100 + 10 * step + r);
      at::Tensor x = at::randn({2, 8, 32}, gen);
      at::Tensor g = at::randn({2, 8, 32}, gen) * 1e-2;
      if (refresh) kfacs_[r]->Capture(0);
      EXPECT_TRUE(stages_[r]->Forward(0, x).ok());
      EXPECT_TRUE(stages_[r]->Backward(0, g).ok());
      at::Tensor pre = Flat(*stages_[r]);
      EXPECT_TRUE(kfacs_[r]->PreconditionFlat(stages_[r]->Parameters(), &pre).ok());
      payloads.push_back(at::cat({pre, kfacs_[r]->ReadyVotes()}));
    }
    const at::Tensor sum = payloads[0] + payloads[1];
    const int64_t n = Numel(*stages_[0]);
    at::Tensor wq;
    for (int r = 0; r < 2; ++r) {
      EXPECT_TRUE(kfacs_[r]->AgreeReady(sum.narrow(0, n, sum.numel() - n), 2).ok());
      Unflat(*stages_[r], sum.narrow(0, 0, n) / 2.0);
      if (r == 0) wq = Param(*stages_[0], "layers.2.wq").grad().clone();
      EXPECT_TRUE(adams_[r]->Step(1e-3).ok());
      (void)kfacs_[r]->CommitAgreement();
      stages_[r]->ZeroGrad();
      if (refresh) {
        EXPECT_TRUE(kfacs_[r]->RefreshSerially().ok());
        kfacs_[r]->DropAllCaptures();
      }
    }
    return wq;
  }

  v1::JobSpec spec_;
  std::vector<std::unique_ptr<Stage>> stages_;
  std::vector<std::unique_ptr<Kfac>> kfacs_;
  std::vector<std::unique_ptr<AdamW>> adams_;
};

TEST_F(KfacReplicaTest, ReplicasStepIdenticallyFromTheirOwnFactors) {
  ASSERT_TRUE(kfacs_[0]->replicas_precondition());
  // Iteration 0: no inverses yet (AdamW); refresh after it.
  Iterate(0, /*refresh=*/true);
  EXPECT_TRUE(kfacs_[0]->has_inverses(2));
  EXPECT_FALSE(kfacs_[0]->replicas_ready(2));
  // Each replica's factors are its own data's: different.
  EXPECT_GT(MaxAbsDiff(kfacs_[0]->FactorA(2, "q"), kfacs_[1]->FactorA(2, "q")), 1e-6);
  // Iteration 1: every replica votes for its layers; still AdamW this step.
  Iterate(1, false);
  EXPECT_TRUE(kfacs_[0]->replicas_ready(2) && kfacs_[1]->replicas_ready(3));
  EXPECT_EQ(kfacs_[0]->last_graft_scale(2, "q"), 0);
  EXPECT_EQ(kfacs_[0]->PreconditionedParameters().size(), 14u);  // 7 per layer
  // Iterations 2-4: preconditioned before the reduce, K-FAC steps.
  std::map<std::string, at::Tensor> before = testing::ToMap(stages_[0]->Parameters());
  for (auto& [name, t] : before) t = t.detach().clone();
  const at::Tensor reduced = Iterate(2, false);
  // The first K-FAC step of a projection: m̂ = ĝ, v̂ = ĝ², so S = ĝ·‖U‖/‖ĝ‖
  // with U = ĝ/(|ĝ|+eps).
  {
    const at::Tensor after = Param(*stages_[0], "layers.2.wq").detach();
    const at::Tensor step = (before["layers.2.wq"] - after) / 1e-3;
    const at::Tensor u = reduced / (reduced.abs() + 1e-8);
    EXPECT_NEAR(step.norm().item<double>(), u.norm().item<double>(),
                1e-3 * u.norm().item<double>());
    const double cosine =
        (step * reduced).sum().item<double>() / (step.norm() * reduced.norm()).item<double>();
    EXPECT_GT(cosine, 1 - 1e-4);
    EXPECT_GT(kfacs_[0]->last_graft_scale(2, "q"), 0);
  }
  Iterate(3, true);
  Iterate(4, false);
  // Bit-identical replicas, although their factors and inverses differ.
  const auto p0 = stages_[0]->Parameters();
  const auto p1 = stages_[1]->Parameters();
  for (size_t i = 0; i < p0.size(); ++i) {
    EXPECT_TRUE(at::equal(p0[i].second, p1[i].second)) << p0[i].first;
  }
  EXPECT_GT(MaxAbsDiff(kfacs_[0]->InverseB(3, "down"), kfacs_[1]->InverseB(3, "down")), 1e-6);
  // The agreement is state: a joining replica or a resumed job keeps it.
  auto load = Kfac::Create(stages_[1].get(), spec_.optimizer());
  ASSERT_TRUE(load.ok());
  std::map<std::string, at::Tensor> table;
  for (auto& [name, t] : kfacs_[0]->State()) table[name] = t;
  ASSERT_TRUE(table.count("kfac.2.replicas_ready"));
  ASSERT_TRUE((*load)->LoadState(table).ok());
  EXPECT_TRUE((*load)->replicas_ready(2));
}

TEST_F(KfacReplicaTest, ALayerIsReadyOnlyWhenEveryReplicaHoldsInverses) {
  // Replica 0 has inverses, replica 1 none: 1 vote of 2.
  kfacs_[0]->Capture(0);
  ASSERT_TRUE(stages_[0]->Forward(0, at::randn({2, 8, 32})).ok());
  ASSERT_TRUE(stages_[0]->Backward(0, at::randn({2, 8, 32}) * 1e-2).ok());
  ASSERT_TRUE(kfacs_[0]->RefreshSerially().ok());
  const at::Tensor votes = kfacs_[0]->ReadyVotes() + kfacs_[1]->ReadyVotes();
  EXPECT_EQ(votes.sum().item<float>(), 2.0f);  // two layers, one vote each
  for (auto& k : kfacs_) {
    ASSERT_TRUE(k->AgreeReady(votes, 2).ok());
    (void)k->CommitAgreement();
    EXPECT_FALSE(k->replicas_ready(2));
    EXPECT_TRUE(k->PreconditionedParameters().empty());
  }
  // A malformed vote tensor is refused by name.
  absl::Status bad = kfacs_[0]->AgreeReady(at::ones({5}), 2);
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.message().find("votes"), std::string::npos);
  // The momentum rule cannot run on preconditioned gradients.
  v1::OptimizerSpec o = spec_.optimizer();
  o.mutable_kfac()->set_update(v1::KFAC_UPDATE_MOMENTUM);
  EXPECT_EQ(Kfac::Create(stages_[0].get(), o).status().code(), absl::StatusCode::kInvalidArgument);
  // AUTO is the coordinator's to resolve: a worker never guesses a scheme
  // its replicas might guess differently.
  v1::OptimizerSpec unresolved = spec_.optimizer();
  unresolved.mutable_kfac()->set_replica_sync(v1::KFAC_REPLICA_SYNC_AUTO);
  auto refused = Kfac::Create(stages_[0].get(), unresolved);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("KFAC_REPLICA_SYNC_AUTO"), std::string::npos)
      << refused.status();
}

TEST(KfacWorkloadTest, PendingFactorsAreWhatThePlannerPrices) {
  // GQA (kv 2 of 4 heads) and ffn ≠ 4d: the shared workload's sizes are the
  // runtime's tensors.
  const v1::JobSpec spec = TwoStageSpec();
  auto stage = Stage::FromJobSpec(spec, 1, at::Device(at::kCPU));
  ASSERT_TRUE(stage.ok());
  auto k = Kfac::Create(stage->get(), spec.optimizer());
  ASSERT_TRUE(k.ok());
  const kfac::BlockWorkload block(spec.model());
  int64_t numel = 0;
  for (const at::Tensor& t : (*k)->PendingFactorTensors(2)) numel += t.numel();
  EXPECT_EQ(numel, block.FactorSyncElements());
  int64_t weights = 0;
  for (auto& [name, p] : (*stage)->Parameters()) {
    if (name.rfind("layers.2.w", 0) == 0) weights += p.numel();
  }
  EXPECT_EQ(weights, block.ProjectionElements());
  EXPECT_EQ(KfacModules(), kfac::ModuleNames());
}

// ---- Engine ------------------------------------------------------------------

TEST(KfacEngineTest, LossFallsOnAFixedBatch) {
  at::set_num_threads(1);
  v1::JobSpec spec = SmallSpec();
  spec.mutable_optimizer()->set_kind(v1::OPTIMIZER_KFAC);
  spec.mutable_optimizer()->mutable_adamw()->set_lr(3e-3);
  spec.mutable_optimizer()->mutable_kfac()->set_lr(3e-3);
  spec.mutable_optimizer()->mutable_kfac()->set_refresh_interval(2);
  spec.mutable_optimizer()->set_constant_lr(true);
  auto engine = PipelineEngine::Create(spec, at::Device(at::kCPU));
  ASSERT_TRUE(engine.ok()) << engine.status();
  ASSERT_NE((*engine)->kfac(0), nullptr);
  EXPECT_EQ((*engine)->kfac_refresh_interval(), 2u);
  auto data = SplitText(GenerateCorpus(1, 20000), 0.0);
  ASSERT_TRUE(data.ok());
  auto mbs = IterationMicrobatches(spec, data->train, 0, at::Device(at::kCPU));
  ASSERT_TRUE(mbs.ok());
  std::vector<v1::Route> routes;
  for (uint32_t mb = 0; mb < 4; ++mb) routes.push_back(MakeRoute(mb, {0, 1, 2, 3}));
  std::vector<double> losses;
  for (uint64_t it = 0; it < 8; ++it) {
    auto stats = (*engine)->RunIteration(it, routes, *mbs);
    ASSERT_TRUE(stats.ok()) << stats.status();
    EXPECT_TRUE(std::isfinite(stats->loss));
    losses.push_back(stats->loss);
  }
  for (int s = 0; s < 4; ++s) {
    EXPECT_TRUE((*engine)->kfac(s)->has_inverses(s)) << s;  // one block per stage
    EXPECT_FALSE((*engine)->kfac(s)->captured(0));          // dropped after the step
  }
  EXPECT_LT(losses.back(), losses.front() - 0.5);

  v1::JobSpec adam_spec = SmallSpec();
  auto plain = PipelineEngine::Create(adam_spec, at::Device(at::kCPU));
  ASSERT_TRUE(plain.ok());
  EXPECT_EQ((*plain)->kfac(0), nullptr);
}

}  // namespace
}  // namespace detour::model
