#pragma once
// Differentiable collectives and a way to give any computation a hand-written backward.
//
// Collectives with autograd run their backward collective in the same group, so every rank must
// run the same backward graph in the same order (it does: each rank builds the same graph, and
// the CPU autograd engine orders ready nodes by creation order).

#include "moeplan/executor/libtorch.h"

#include <functional>
#include <string>
#include <vector>

#include "moeplan/executor/ranks/collectives.h"

namespace moeplan::executor {

using TensorList = std::vector<torch::Tensor>;
// Receives the gradient of each output (an undefined tensor for an output that got none) and
// returns the gradient of each input (undefined where there is none).
using BackwardFn = std::function<TensorList(TensorList&& output_grads)>;

// Makes `outputs` (computed from `inputs` without autograd) differentiable with `backward`.
// Does nothing when grad mode is off or no input requires a gradient.
void attach_backward(const TensorList& inputs, TensorList& outputs, const std::string& name, BackwardFn backward);

// all-to-all of rows (see Communicator::all_to_all); backward sends the gradients back.
torch::Tensor all_to_all_autograd(Communicator& comm, const torch::Tensor& input, const std::vector<int64_t>& send_rows,
                                  const std::vector<int64_t>& recv_rows);
// Concatenation of every rank's tensor; backward: reduce-scatter of the gradient.
torch::Tensor all_gather_autograd(Communicator& comm, const torch::Tensor& input);
// This rank's chunk of the sum; backward: all-gather of the gradient.
torch::Tensor reduce_scatter_autograd(Communicator& comm, const torch::Tensor& input);
// The sum over the ranks; backward: the gradient as it is. Right where every rank goes on to
// compute the same function of the sum (a loss every rank of a tensor-parallel group computes
// alike), so each rank's input gets the whole gradient once.
torch::Tensor all_reduce_autograd(Communicator& comm, const torch::Tensor& input);

}  // namespace moeplan::executor
