#include "moeplan/executor/model/autograd_ops.h"

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>

#include <memory>
#include <type_traits>

namespace moeplan::executor {

namespace {

class LambdaBackward : public torch::autograd::Node {
 public:
  LambdaBackward(std::string name, BackwardFn backward) : name_(std::move(name)), backward_(std::move(backward)) {}
  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    return backward_(std::move(grads));
  }
  std::string name() const override { return name_; }
  void release_variables() override { backward_ = nullptr; }

 private:
  std::string name_;
  BackwardFn backward_;
};

// A graph node as this LibTorch holds them: by intrusive pointer from 2.12 on, by shared
// pointer before (2.11 is the one on the CUDA machines' images).
template <class T, class... Args>
auto make_node(Args&&... args) {
  if constexpr (std::is_base_of_v<c10::intrusive_ptr_target, T>)
    return c10::make_intrusive<T>(std::forward<Args>(args)...);
  else
    return std::make_shared<T>(std::forward<Args>(args)...);
}

}  // namespace

void attach_backward(const TensorList& inputs, TensorList& outputs, const std::string& name, BackwardFn backward) {
  if (!torch::autograd::compute_requires_grad(inputs)) return;
  auto node = make_node<LambdaBackward>(name, std::move(backward));
  node->set_next_edges(torch::autograd::collect_next_edges(inputs));
  for (torch::Tensor& out : outputs) {
    // detach() drops any autograd view relation an output may carry.
    if (out.defined()) out = out.detach();
    torch::autograd::set_history(out, node);
  }
}

torch::Tensor all_to_all_autograd(Communicator& comm, const torch::Tensor& input, const std::vector<int64_t>& send_rows,
                                  const std::vector<int64_t>& recv_rows) {
  TensorList out{comm.all_to_all(input.detach(), send_rows, recv_rows)};
  const std::vector<int64_t> in_shape = input.sizes().vec();
  const torch::TensorOptions options = input.options().requires_grad(false);
  attach_backward({input}, out, "AllToAllBackward", [&comm, send_rows, recv_rows, in_shape, options](TensorList&& g) {
    const torch::Tensor grad = g[0].defined() ? g[0] : torch::Tensor();
    if (!grad.defined()) {
      // Peers still expect this rank's rows: send zeros.
      std::vector<int64_t> shape = in_shape;
      int64_t rows = 0;
      for (const int64_t r : recv_rows) rows += r;
      shape[0] = rows;
      return TensorList{comm.all_to_all(torch::zeros(shape, options), recv_rows, send_rows)};
    }
    return TensorList{comm.all_to_all(grad, recv_rows, send_rows)};
  });
  return out[0];
}

torch::Tensor all_gather_autograd(Communicator& comm, const torch::Tensor& input) {
  TensorList out{comm.all_gather(input.detach())};
  const std::vector<int64_t> full_shape = out[0].sizes().vec();
  const torch::TensorOptions options = input.options().requires_grad(false);
  attach_backward({input}, out, "AllGatherBackward", [&comm, full_shape, options](TensorList&& g) {
    const torch::Tensor grad = g[0].defined() ? g[0] : torch::zeros(full_shape, options);
    return TensorList{comm.reduce_scatter_sum(grad)};
  });
  return out[0];
}

torch::Tensor reduce_scatter_autograd(Communicator& comm, const torch::Tensor& input) {
  TensorList out{comm.reduce_scatter_sum(input.detach())};
  const std::vector<int64_t> part_shape = out[0].sizes().vec();
  const torch::TensorOptions options = input.options().requires_grad(false);
  attach_backward({input}, out, "ReduceScatterBackward", [&comm, part_shape, options](TensorList&& g) {
    const torch::Tensor grad = g[0].defined() ? g[0] : torch::zeros(part_shape, options);
    return TensorList{comm.all_gather(grad)};
  });
  return out[0];
}

torch::Tensor all_reduce_autograd(Communicator& comm, const torch::Tensor& input) {
  TensorList out{input.detach().clone()};
  comm.all_reduce_sum(out[0]);
  attach_backward({input}, out, "AllReduceBackward", [](TensorList&& g) { return TensorList{g[0]}; });
  return out[0];
}

}  // namespace moeplan::executor
