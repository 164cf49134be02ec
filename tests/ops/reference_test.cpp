// The float kernels against PyTorch's values (tests/data/reference.json, written by
// tools/reference/generate_reference.py in float64 from the same float32 inputs).
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>

#include "weave/ops/activation.hpp"
#include "weave/ops/attention.hpp"
#include "weave/ops/cross_entropy.hpp"
#include "weave/ops/normalization.hpp"
#include "weave/ops/optimizer.hpp"
#include "weave/ops/rotary.hpp"
#include "weave/ops/router.hpp"
#include "weave/ops/softmax.hpp"

namespace weave::ops {
namespace {

using nlohmann::json;

const json& reference() {
  static const json data = [] {
    std::ifstream in(WEAVE_TEST_DATA_DIR "/reference.json");
    if (!in) throw std::runtime_error("cannot open tests/data/reference.json");
    return json::parse(in);
  }();
  return data;
}

Shape shape_of(const json& t) {
  const auto dims = t.at("shape").get<std::vector<std::int64_t>>();
  switch (dims.size()) {
    case 0:
      return Shape{};
    case 1:
      return Shape{dims[0]};
    case 2:
      return Shape{dims[0], dims[1]};
    case 3:
      return Shape{dims[0], dims[1], dims[2]};
    default:
      return Shape{dims[0], dims[1], dims[2], dims[3]};
  }
}

Tensor load(const json& t) {
  const auto values = t.at("data").get<std::vector<double>>();
  std::vector<float> f(values.begin(), values.end());
  return Tensor::from(f, shape_of(t));
}

// float32 kernels against float64 references: a few float ulps of the larger magnitudes.
void expect_matches(const Tensor& got, const json& want, const char* what, double tol = 2e-5) {
  ASSERT_EQ(got.shape(), shape_of(want)) << what;
  const auto g = got.to_vector();
  const auto w = want.at("data").get<std::vector<double>>();
  for (std::size_t i = 0; i < w.size(); ++i)
    ASSERT_NEAR(g[i], w[i], tol * std::max(1.0, std::abs(w[i]))) << what << " element " << i;
}

TEST(Reference, LayerNorm) {
  const json& c = reference().at("layer_norm");
  const Tensor x = load(c["x"]), w = load(c["weight"]), b = load(c["bias"]), dy = load(c["dy"]);
  const Tensor y = Tensor::empty(x.shape()), mean = Tensor::empty({4}), rstd = Tensor::empty({4});
  layer_norm_forward(x, w, b, c["eps"].get<double>(), y, mean, rstd);
  expect_matches(y, c["y"], "y");
  const Tensor dx = Tensor::empty(x.shape()), dw = Tensor::zeros(w.shape()),
               db = Tensor::zeros(b.shape());
  layer_norm_backward(x, w, mean, rstd, dy, dx, dw, db);
  expect_matches(dx, c["dx"], "dx");
  expect_matches(dw, c["dweight"], "dweight");
  expect_matches(db, c["dbias"], "dbias");
}

TEST(Reference, CausalAttentionWholeAndChunk) {
  const json& c = reference().at("attention");
  const Tensor q = load(c["q"]), k = load(c["k"]), v = load(c["v"]), d_o = load(c["do"]);
  const Tensor o = Tensor::empty(q.shape()), lse = Tensor::empty({2, 2, 12});
  attention_forward({}, q, k, v, o, lse);
  expect_matches(o, c["o"], "o");
  expect_matches(lse, c["lse"], "lse");
  const Tensor dq = Tensor::empty(q.shape()), dk = Tensor::zeros(k.shape()),
               dv = Tensor::zeros(v.shape());
  attention_backward({}, q, k, v, o, lse, d_o, dq, dk, dv);
  expect_matches(dq, c["dq"], "dq");
  expect_matches(dk, c["dk"], "dk");
  expect_matches(dv, c["dv"], "dv");

  const json& ch = reference().at("attention_chunk");
  const AttentionOptions opt{.q_offset = ch["q_offset"].get<std::int64_t>()};
  const Tensor qc = load(ch["q"]), doc = load(ch["do"]);
  const Tensor oc = Tensor::empty(qc.shape()), lsec = Tensor::empty({2, 2, qc.dim(1)});
  attention_forward(opt, qc, k, v, oc, lsec);
  expect_matches(oc, ch["o"], "chunk o");
  expect_matches(lsec, ch["lse"], "chunk lse");
  const Tensor dqc = Tensor::empty(qc.shape()), dkc = Tensor::zeros(k.shape()),
               dvc = Tensor::zeros(v.shape());
  attention_backward(opt, qc, k, v, oc, lsec, doc, dqc, dkc, dvc);
  expect_matches(dqc, ch["dq"], "chunk dq");
  expect_matches(dkc, ch["dk"], "chunk dk");
  expect_matches(dvc, ch["dv"], "chunk dv");
}

TEST(Reference, CrossEntropyPlainAndSmoothed) {
  const json& c = reference().at("cross_entropy");
  const Tensor logits = load(c["logits"]);
  const auto targets = c["targets"].get<std::vector<std::int32_t>>();
  for (const char* key : {"plain", "smoothed"}) {
    const json& k = c[key];
    const CrossEntropyOptions opt{.ignore_index = c["ignore_index"].get<std::int32_t>(),
                                  .label_smoothing = k["label_smoothing"].get<double>()};
    const Tensor lse = Tensor::empty({logits.dim(0)});
    const double loss = cross_entropy_forward<float>(logits, targets, opt, lse);
    EXPECT_NEAR(loss, k["loss"].get<double>(), 2e-6 * std::abs(k["loss"].get<double>())) << key;
    const Tensor d = Tensor::empty(logits.shape());
    cross_entropy_backward<float>(logits, targets, {}, lse, opt, 1.0, d);
    expect_matches(d, k["dlogits"], key);
  }
}

TEST(Reference, RouterTopKAuxAndZLoss) {
  const json& c = reference().at("router");
  const Tensor logits = load(c["logits"]), g = load(c["g"]);
  const std::int64_t T = logits.dim(0), E = logits.dim(1);
  for (const char* key : {"renormalized", "raw"}) {
    const json& k = c[key];
    const RouterOptions opt{.top_k = c["top_k"].get<int>(),
                            .renormalize = std::string(key) == "renormalized",
                            .aux_loss_coeff = c["aux_coeff"].get<double>(),
                            .z_loss_coeff = c["z_coeff"].get<double>()};
    const Tensor probs = Tensor::empty({T, E}), w = Tensor::empty({T, opt.top_k});
    std::vector<std::int32_t> index(static_cast<std::size_t>(T * opt.top_k));
    const RouterStatistics stats = router_forward(opt, logits, probs, std::span(index), w);
    EXPECT_EQ(index, k["index"].get<std::vector<std::int32_t>>()) << key;
    expect_matches(probs, k["probs"], "probs");
    expect_matches(w, k["weights"], "weights");
    EXPECT_NEAR(aux_loss(opt, stats), k["aux_loss"].get<double>(), 1e-8) << key;
    EXPECT_NEAR(z_loss(opt, stats), k["z_loss"].get<double>(), 1e-8) << key;
    const Tensor d = Tensor::empty({T, E});
    router_backward<float>(opt, logits, probs, index, w, g, stats, 1.0, d);
    expect_matches(d, k["dlogits"], key);
  }
}

TEST(Reference, AdamWTwoSteps) {
  const json& c = reference().at("adamw");
  const AdamWOptions opt{.lr = c["lr"].get<double>(),
                         .beta1 = c["betas"][0].get<double>(),
                         .beta2 = c["betas"][1].get<double>(),
                         .eps = c["eps"].get<double>(),
                         .weight_decay = c["weight_decay"].get<double>()};
  for (std::size_t p = 0; p < 2; ++p) {
    const Tensor param = load(c["params"][p]);
    const Tensor m = Tensor::zeros(param.shape()), v = Tensor::zeros(param.shape());
    for (int step = 1; step <= 2; ++step) {
      adamw_step(opt, step, param, load(c["grads"][step - 1][p]), m, v);
      expect_matches(param, c["after"][step - 1][p], "param", 1e-6);
    }
    expect_matches(m, c["exp_avg"][p], "exp_avg", 1e-6);
    expect_matches(v, c["exp_avg_sq"][p], "exp_avg_sq", 1e-6);
  }
}

TEST(Reference, RmsNormSoftmaxAndGelu) {
  const json& rn = reference().at("rms_norm");
  const Tensor x = load(rn["x"]), w = load(rn["weight"]), dy = load(rn["dy"]);
  const Tensor y = Tensor::empty(x.shape()), rstd = Tensor::empty({x.dim(0)});
  rms_norm_forward(x, w, rn["eps"].get<double>(), y, rstd);
  expect_matches(y, rn["y"], "rms y");
  const Tensor dx = Tensor::empty(x.shape()), dw = Tensor::zeros(w.shape());
  rms_norm_backward(x, w, rstd, dy, dx, dw);
  expect_matches(dx, rn["dx"], "rms dx");
  expect_matches(dw, rn["dweight"], "rms dweight");

  const json& sm = reference().at("softmax");
  const Tensor sx = load(sm["x"]), sdy = load(sm["dy"]);
  const Tensor sy = Tensor::empty(sx.shape()), sdx = Tensor::empty(sx.shape());
  softmax_forward(sx, sy);
  softmax_backward(sy, sdy, sdx);
  expect_matches(sy, sm["y"], "softmax y");
  expect_matches(sdx, sm["dx"], "softmax dx");

  const json& g = reference().at("gelu");
  const Tensor gx = load(g["x"]);
  for (const auto& [key, form] :
       {std::pair{"tanh", GeluForm::tanh}, std::pair{"none", GeluForm::erf}}) {
    const Tensor gy = Tensor::empty(gx.shape()), ones = Tensor::empty(gx.shape()),
                 slope = Tensor::empty(gx.shape());
    ones.fill(1.f);
    gelu_forward(form, gx, gy);
    gelu_backward(form, gx, ones, slope);
    expect_matches(gy, g[key]["y"], key);
    expect_matches(slope, g[key]["dydx"], key);
  }
}

TEST(Reference, SgdMomentumAndGradientClipping) {
  const json& c = reference().at("sgd_momentum");
  const SgdOptions opt{.lr = c["lr"].get<double>(),
                       .momentum = c["momentum"].get<double>(),
                       .dampening = c["dampening"].get<double>(),
                       .weight_decay = c["weight_decay"].get<double>(),
                       .nesterov = c["nesterov"].get<bool>()};
  for (std::size_t p = 0; p < 2; ++p) {
    const Tensor param = load(c["params"][p]);
    const Tensor buffer = Tensor::zeros(param.shape());
    for (int step = 1; step <= 2; ++step) {
      sgd_step(opt, step, param, load(c["grads"][step - 1][p]), buffer);
      expect_matches(param, c["after"][step - 1][p], "sgd param", 1e-6);
    }
    expect_matches(buffer, c["momentum_buffer"][p], "momentum buffer", 1e-6);
  }
  const json& k = reference().at("clip_grad_norm");
  std::vector<Tensor> grads{load(k["grads"][0]), load(k["grads"][1])};
  const double norm = clip_grad_norm<float>(grads, k["max_norm"].get<double>());
  EXPECT_NEAR(norm, k["total_norm"].get<double>(), 1e-6 * norm);
  expect_matches(grads[0], k["clipped"][0], "clipped 0", 1e-6);
  expect_matches(grads[1], k["clipped"][1], "clipped 1", 1e-6);
}

TEST(Reference, RotaryEmbedding) {
  const json& c = reference().at("rotary");
  const Tensor x = load(c["x"]), dy = load(c["dy"]);
  const RotarySpec spec{.head_dim = c["head_dim"].get<std::int64_t>(),
                        .rotary_dims = c["rotary_dims"].get<std::int64_t>(),
                        .base = c["base"].get<double>()};
  const auto positions = c["positions"].get<std::vector<std::int64_t>>();
  const Tensor y = x.clone();
  rotary_forward(spec, y, positions);
  expect_matches(y, c["y"], "y");
  const Tensor dx = dy.clone();
  rotary_backward(spec, dx, positions);
  expect_matches(dx, c["dx"], "dx");
}

TEST(Reference, GroupedQueryAttention) {
  const json& c = reference().at("grouped_query_attention");
  const Tensor q = load(c["q"]), k = load(c["k"]), v = load(c["v"]), d_o = load(c["do"]);
  const std::int64_t B = q.dim(0), S = q.dim(1), H = q.dim(2), D = q.dim(3), G = k.dim(2);
  // The kernel reads each group's query heads side by side: [B, S, G, (H / G) D].
  const Tensor qg = q.reshape({B, S, G, H / G * D}), dog = d_o.reshape(qg.shape());
  const Tensor o = Tensor::empty(qg.shape()), lse = Tensor::empty({B, H, S});
  attention_forward({}, qg, k, v, o, lse);
  expect_matches(o.reshape(q.shape()), c["o"], "o");
  expect_matches(lse, c["lse"], "lse");
  const Tensor dq = Tensor::empty(qg.shape()), dk = Tensor::zeros(k.shape()),
               dv = Tensor::zeros(v.shape());
  attention_backward({}, qg, k, v, o, lse, dog, dq, dk, dv);
  expect_matches(dq.reshape(q.shape()), c["dq"], "dq");
  expect_matches(dk, c["dk"], "dk");
  expect_matches(dv, c["dv"], "dv");
}

}  // namespace
}  // namespace weave::ops
