// Shapes, tensor metadata and tensors.
//
// TensorMeta is what the graph knows about an object before anything runs: shape, dtype and
// device. Sizes are therefore known at graph-build time, which is what lets a planner reason
// about memory. A Tensor is a TensorMeta plus a view into a Buffer: contiguous, row-major, at an
// element offset. Several tensors may share one buffer (e.g. the named parameters of a layer are
// views into the layer's flat parameter buffer).
//
// Thread safety: a Tensor is a value (meta + shared_ptr). Concurrent reads of the elements are
// fine; writers must be the only task holding the tensor, which the executor guarantees.
#pragma once

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "core/allocator.h"
#include "core/device.h"
#include "core/dtype.h"
#include "core/status.h"

namespace tessera {

class Shape {
 public:
  Shape() = default;  // a scalar: rank 0, one element
  Shape(std::initializer_list<int64_t> dims) : dims_(dims) {}
  explicit Shape(std::vector<int64_t> dims) : dims_(std::move(dims)) {}

  int rank() const { return static_cast<int>(dims_.size()); }
  // REQUIRES: -rank() <= axis < rank(); negative axes count from the end.
  int64_t operator[](int axis) const { return dims_[axis < 0 ? axis + rank() : axis]; }
  const std::vector<int64_t>& dims() const { return dims_; }
  int64_t numel() const;

  friend bool operator==(const Shape&, const Shape&) = default;
  // "[4, 64, 256]"
  std::string ToString() const;

 private:
  std::vector<int64_t> dims_;
};

struct TensorMeta {
  Shape shape;
  DType dtype = DType::kF32;
  Device device = Device::Cpu();

  int64_t numel() const { return shape.numel(); }
  int64_t bytes() const { return shape.numel() * DTypeSize(dtype); }
  friend bool operator==(const TensorMeta&, const TensorMeta&) = default;
  // "f32[4, 64, 256]" (device appended when not cpu: "bf16[768]@cuda:0").
  std::string ToString() const;
  // Whether a value of this meta may be bound to a graph input of `input`: the same shape and
  // dtype, on the input's device or on the host (an executor with a GPU copies a host value of
  // a device input there: a driver's batch for a GPU worker).
  bool BindsTo(const TensorMeta& input) const {
    return shape == input.shape && dtype == input.dtype &&
           (device == input.device || device.is_cpu());
  }
};

class Tensor {
 public:
  Tensor() = default;  // undefined: no buffer

  // Uninitialised host tensor. ResourceExhausted when the allocator fails.
  static Result<Tensor> Empty(const TensorMeta& meta, std::shared_ptr<Allocator> allocator);
  static Result<Tensor> Zeros(const TensorMeta& meta, std::shared_ptr<Allocator> allocator);
  // A tensor over an existing buffer. REQUIRES: the view fits inside the buffer.
  Tensor(TensorMeta meta, std::shared_ptr<Buffer> buffer, int64_t byte_offset = 0);

  bool defined() const { return buffer_ != nullptr; }
  const TensorMeta& meta() const { return meta_; }
  const Shape& shape() const { return meta_.shape; }
  DType dtype() const { return meta_.dtype; }
  int64_t numel() const { return meta_.numel(); }
  int64_t bytes() const { return meta_.bytes(); }
  const std::shared_ptr<Buffer>& buffer() const { return buffer_; }
  int64_t byte_offset() const { return byte_offset_; }  // where it starts in its buffer

  void* raw_data() const { return static_cast<char*>(buffer_->data()) + byte_offset_; }
  // Typed element access. REQUIRES: defined() and dtype() matches T (checked).
  template <typename T>
  T* data() const {
    TESSERA_CHECK(defined() && dtype() == DTypeOf<T>::kValue, "tensor {} accessed as {}",
                  meta_.ToString(), DTypeName(DTypeOf<T>::kValue));
    return static_cast<T*>(raw_data());
  }

  // A tensor of `shape` over elements [element_offset, element_offset + shape.numel()) of this
  // one, sharing the buffer. InvalidArgument when it does not fit.
  Result<Tensor> View(Shape shape, int64_t element_offset = 0) const;
  // Same elements, new shape with the same number of elements.
  Result<Tensor> Reshape(Shape shape) const { return View(std::move(shape), 0); }

  // Deep copy into a new buffer from `allocator`.
  Result<Tensor> Clone(std::shared_ptr<Allocator> allocator) const;

  // A host tensor holding a copy of `values` (f32, i32, i64 ...): a batch a driver feeds.
  // InvalidArgument when their count is not the shape's.
  template <typename T>
  static Result<Tensor> FromVector(Shape shape, const std::vector<T>& values) {
    const TensorMeta meta{std::move(shape), DTypeOf<T>::kValue, Device::Cpu()};
    if (meta.numel() != static_cast<int64_t>(values.size())) {
      return InvalidArgument("{} values do not fill {}", values.size(), meta.ToString());
    }
    TESSERA_ASSIGN_OR_RETURN(Tensor t, Empty(meta, SharedHostAllocator()));
    std::copy(values.begin(), values.end(), t.data<T>());
    return t;
  }

 private:
  TensorMeta meta_;
  std::shared_ptr<Buffer> buffer_;
  int64_t byte_offset_ = 0;
};

}  // namespace tessera
