#include "core/tensor.h"

#include <cstring>

#include <fmt/ranges.h>

namespace tessera {

int64_t Shape::numel() const {
  int64_t n = 1;
  for (int64_t d : dims_) n *= d;
  return n;
}

std::string Shape::ToString() const { return fmt::format("[{}]", fmt::join(dims_, ", ")); }

std::string TensorMeta::ToString() const {
  std::string text = fmt::format("{}{}", DTypeName(dtype), shape.ToString());
  if (!device.is_cpu()) text = fmt::format("{}@{}", text, device.ToString());
  return text;
}

Tensor::Tensor(TensorMeta meta, std::shared_ptr<Buffer> buffer, int64_t byte_offset)
    : meta_(std::move(meta)), buffer_(std::move(buffer)), byte_offset_(byte_offset) {
  TESSERA_CHECK(buffer_ != nullptr);
  TESSERA_CHECK(byte_offset_ >= 0 && byte_offset_ + meta_.bytes() <= buffer_->size(),
                "view {} at byte {} exceeds buffer of {} bytes", meta_.ToString(), byte_offset_,
                buffer_->size());
}

Result<Tensor> Tensor::Empty(const TensorMeta& meta, std::shared_ptr<Allocator> allocator) {
  for (int64_t d : meta.shape.dims()) {
    if (d < 0) return InvalidArgument("negative dimension in {}", meta.ToString());
  }
  if (meta.device.kind != allocator->kind()) {
    return InvalidArgument("cannot allocate {} from the {} allocator", meta.ToString(),
                           allocator->Name());
  }
  TESSERA_ASSIGN_OR_RETURN(auto buffer, Buffer::Allocate(meta.bytes(), std::move(allocator)));
  return Tensor(meta, std::move(buffer));
}

Result<Tensor> Tensor::Zeros(const TensorMeta& meta, std::shared_ptr<Allocator> allocator) {
  TESSERA_ASSIGN_OR_RETURN(Tensor tensor, Empty(meta, std::move(allocator)));
  std::memset(tensor.raw_data(), 0, static_cast<size_t>(tensor.bytes()));
  return tensor;
}

Result<Tensor> Tensor::View(Shape shape, int64_t element_offset) const {
  TESSERA_CHECK(defined());
  const int64_t element_size = DTypeSize(dtype());
  const int64_t new_offset = byte_offset_ + element_offset * element_size;
  if (element_offset < 0 || element_offset + shape.numel() > numel()) {
    return InvalidArgument("view {} at element {} does not fit in tensor {}", shape.ToString(),
                           element_offset, meta_.ToString());
  }
  TensorMeta view_meta{std::move(shape), meta_.dtype, meta_.device};
  return Tensor(std::move(view_meta), buffer_, new_offset);
}

Result<Tensor> Tensor::Clone(std::shared_ptr<Allocator> allocator) const {
  TESSERA_ASSIGN_OR_RETURN(Tensor copy, Empty(meta_, std::move(allocator)));
  std::memcpy(copy.raw_data(), raw_data(), static_cast<size_t>(bytes()));
  return copy;
}

}  // namespace tessera
