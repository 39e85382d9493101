// Rows of many arrays gathered in one MLX primitive (CPU): a batch cache's `take_rows` (mlx_lm's `extract` of a
// finished request and `filter` of the rest) copies the chosen rows of every stored array (sink, tail, key and
// value codes, fitted parameters: a dozen arrays per layer). One `mx.take` each cost a graph operation each
// (~0.2 ms per layer at 8 rows, most of it the operations' overhead); here one operation copies them all.
//
// inputs: arrays (N_i * fold_i, ...) of any dtype, possibly strided views; rows r_0..r_{k-1} (< N_i) and, per
// array, fold_i rows per item (a folded (B*H, ...) array: item r is rows r*fold .. r*fold+fold-1).
// outputs: (k * fold_i, ...) row-contiguous arrays of their own (nothing of the inputs' buffers is shared).
// The reference is mx.take(a, rows, axis=0) (tests/test_batch_cache.py compares them).
#include <nanobind/nanobind.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "mlx/allocator.h"
#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"
#include "mlx/utils.h"

namespace nb = nanobind;
using namespace mlx::core;

namespace vq_gather {

// Copies the slab of `a` starting at element offset `base` (dims 1.. of `a`, through its strides) to `out`.
void copy_slab(const array& a, int64_t base, char* out) {
  const size_t item = a.itemsize();
  const int nd = a.ndim();
  const char* src = a.data<char>();
  const auto& sh = a.shape();
  const auto& st = a.strides();
  if (nd == 1) {
    std::memcpy(out, src + base * item, item);
    return;
  }
  // innermost contiguous run: the last axis when its stride is 1
  const int64_t run = st[nd - 1] == 1 ? sh[nd - 1] : 1;
  const int inner_dims = run > 1 ? nd - 2 : nd - 1;  // axes 1..inner_dims are iterated
  int64_t count = 1;
  for (int k = 1; k <= inner_dims; ++k) count *= sh[k];
  std::vector<int64_t> idx(nd, 0);
  for (int64_t c = 0; c < count; ++c) {
    int64_t off = base;
    for (int k = 1; k <= inner_dims; ++k) off += idx[k] * st[k];
    std::memcpy(out, src + off * item, run * item);
    out += run * item;
    for (int k = inner_dims; k >= 1; --k) {  // odometer over the iterated axes
      if (++idx[k] < sh[k]) break;
      idx[k] = 0;
    }
  }
}

class GatherRows : public Primitive {
 public:
  GatherRows(Stream s, std::vector<int64_t> rows, std::vector<int> folds)
      : Primitive(s), rows_(std::move(rows)), folds_(std::move(folds)) {}
  void eval_cpu(const std::vector<array>& inputs, std::vector<array>& outputs) override {
    for (auto& o : outputs) o.set_data(allocator::malloc(o.nbytes()));
    auto& enc = cpu::get_command_encoder(stream());
    for (auto& a : inputs) enc.set_input_array(a);
    for (auto& o : outputs) enc.set_output_array(o);
    std::vector<array> outs;
    for (auto& o : outputs) outs.push_back(array::unsafe_weak_copy(o));
    enc.dispatch([inputs = inputs, outs = std::move(outs), rows = rows_, folds = folds_]() mutable {
      for (size_t i = 0; i < inputs.size(); ++i) {
        const array& a = inputs[i];
        char* dst = outs[i].data<char>();
        const size_t slab = outs[i].shape(0) ? outs[i].nbytes() / outs[i].shape(0) : 0;
        for (int64_t r : rows)
          for (int f = 0; f < folds[i]; ++f) {
            copy_slab(a, (r * folds[i] + f) * a.strides()[0], dst);
            dst += slab;
          }
      }
    });
  }
  void eval_gpu(const std::vector<array>&, std::vector<array>&) override {
    throw std::runtime_error("veloxquant gather_rows has no GPU implementation (use mx.take)");
  }
  const char* name() const override { return "VeloxquantGatherRows"; }
  bool is_equivalent(const Primitive& other) const override {
    auto& o = static_cast<const GatherRows&>(other);
    return rows_ == o.rows_ && folds_ == o.folds_;
  }

 private:
  std::vector<int64_t> rows_;
  std::vector<int> folds_;
};

std::vector<array> gather_rows(const std::vector<array>& arrays, const std::vector<int64_t>& rows,
                               const std::vector<int>& folds) {
  if (arrays.empty()) return {};
  if (folds.size() != arrays.size())
    throw std::invalid_argument("gather_rows: folds must give one fold per array");
  std::vector<Shape> shapes;
  std::vector<Dtype> dtypes;
  for (size_t i = 0; i < arrays.size(); ++i) {
    const array& a = arrays[i];
    if (a.ndim() < 1 || folds[i] < 1 || a.shape(0) % folds[i])
      throw std::invalid_argument("gather_rows: array " + std::to_string(i) + " does not hold whole items of " +
                                  std::to_string(folds[i]) + " rows");
    const int64_t items = a.shape(0) / folds[i];
    for (int64_t r : rows)
      if (r < 0 || r >= items)
        throw std::invalid_argument("gather_rows: row " + std::to_string(r) + " is out of range for array " +
                                    std::to_string(i) + " of " + std::to_string(items) + " items");
    Shape sh = a.shape();
    sh[0] = int(rows.size()) * folds[i];
    shapes.push_back(sh);
    dtypes.push_back(a.dtype());
  }
  Stream s = to_stream(StreamOrDevice{});
  if (s.device != Device::cpu)
    throw std::invalid_argument("gather_rows: runs on the CPU: make the CPU the default device");
  return array::make_arrays(shapes, dtypes, std::make_shared<GatherRows>(s, rows, folds), arrays);
}

}  // namespace vq_gather

void bind_gather_rows(nb::module_& m) {
  m.def("gather_rows", &vq_gather::gather_rows, nb::arg("arrays"), nb::arg("rows"), nb::arg("folds"),
        "rows of every array (axis 0; fold rows per item) as new row-contiguous arrays, in one operation");
}
