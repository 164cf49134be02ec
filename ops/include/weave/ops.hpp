// weave's operations: Tensor and the kernels with their backward (GEMM, linear, norms,
// activations, dropout, embedding, softmax, cross-entropy, attention, the MoE router, dispatch
// and experts, optimizers, counter-based randomness). See docs/api.md.
#pragma once

#include "weave/ops/activation.hpp"
#include "weave/ops/attention.hpp"
#include "weave/ops/cross_entropy.hpp"
#include "weave/ops/dropout.hpp"
#include "weave/ops/elementwise.hpp"
#include "weave/ops/embedding.hpp"
#include "weave/ops/experts.hpp"
#include "weave/ops/gemm.hpp"
#include "weave/ops/linear.hpp"
#include "weave/ops/moe_dispatch.hpp"
#include "weave/ops/normalization.hpp"
#include "weave/ops/optimizer.hpp"
#include "weave/ops/random.hpp"
#include "weave/ops/router.hpp"
#include "weave/ops/shape.hpp"
#include "weave/ops/sinkhorn.hpp"
#include "weave/ops/softmax.hpp"
#include "weave/ops/tensor.hpp"
