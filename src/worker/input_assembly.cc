#include "worker/input_assembly.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"

namespace pathways {
namespace {

absl::Status CheckSameRank(const Region& region, const Shape& dst_start, size_t rank) {
  if (region.start.size() != rank || region.size.size() != rank || dst_start.size() != rank) {
    return absl::InvalidArgumentError(
        absl::StrCat("input piece of rank ", region.start.size(), " does not match input rank ", rank));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<BufferPtr> AssembleInput(Device& device, absl::Duration memory_wait, const InputPlan& plan,
                                        const std::vector<BufferPtr>& pieces) {
  const size_t n = plan.src_regions.size();
  for (size_t p = 0; p < n; ++p) {
    const BufferPtr& src = pieces[plan.first_piece + p];
    if (src->dtype() != plan.spec.dtype) {
      return absl::InvalidArgumentError(
          absl::StrCat("input is ", DTypeName(src->dtype()), ", expected ", plan.spec.ToString()));
    }
    PW_RETURN_IF_ERROR(CheckSameRank(plan.src_regions[p], plan.dst_starts[p], plan.spec.shape.size()));
    PW_RETURN_IF_ERROR(CheckRegionInside(plan.src_regions[p], src->shape()));
    PW_RETURN_IF_ERROR(CheckRegionInside({plan.dst_starts[p], plan.src_regions[p].size}, plan.spec.shape));
  }
  if (n == 1) {
    const BufferPtr& only = pieces[plan.first_piece];
    if (only->device_index() == device.local_index() && only->shape() == plan.spec.shape &&
        plan.src_regions[0].size == plan.spec.shape) {
      return only;
    }
  }
  PW_ASSIGN_OR_RETURN(BufferPtr out, device.Allocate(plan.spec.dtype, plan.spec.shape, memory_wait));
  if (n == 0) std::memset(out->data(), 0, static_cast<size_t>(out->byte_size()));
  for (size_t p = 0; p < n; ++p) {
    const BufferPtr& src = pieces[plan.first_piece + p];
    CopyRegion(src->data(), src->shape(), plan.src_regions[p].start, plan.src_regions[p].size, DTypeSize(src->dtype()),
               out->data(), plan.spec.shape, plan.dst_starts[p]);
  }
  return out;
}

}  // namespace pathways
