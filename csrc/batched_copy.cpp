// Batched host->device copies for the restore pipeline (vllm_sekv.store.native_copy).
//
// One call issues one cudaMemcpyAsync per run (src byte offset, dst byte offset,
// byte count) from a pinned host tensor into a CUDA tensor on the given stream,
// with the GIL released and without torch's per-copy dispatch and pinned-block
// bookkeeping. Non-blocking; the caller keeps both tensors alive and unmodified
// until the stream has passed the copies. Throws (a Python RuntimeError) on bad
// arguments or a CUDA error, before or while issuing.
#include <torch/extension.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime.h>

namespace {

void h2d_runs(const torch::Tensor& dst, const torch::Tensor& src, const torch::Tensor& runs, int64_t stream_ptr) {
  TORCH_CHECK(dst.is_cuda() && dst.is_contiguous(), "dst must be a contiguous CUDA tensor");
  TORCH_CHECK(src.device().is_cpu() && src.is_contiguous() && src.is_pinned(), "src must be contiguous pinned host memory");
  TORCH_CHECK(runs.device().is_cpu() && runs.scalar_type() == torch::kInt64 && runs.dim() == 2 && runs.size(1) == 3,
              "runs must be an int64 CPU tensor [n, 3]");
  const int64_t dst_bytes = dst.numel() * dst.element_size();
  const int64_t src_bytes = src.numel() * src.element_size();
  auto r = runs.contiguous();
  auto acc = r.accessor<int64_t, 2>();
  for (int64_t i = 0; i < r.size(0); ++i) {
    TORCH_CHECK(acc[i][0] >= 0 && acc[i][1] >= 0 && acc[i][2] >= 0 && acc[i][0] + acc[i][2] <= src_bytes &&
                acc[i][1] + acc[i][2] <= dst_bytes, "run ", i, " out of bounds");
  }
  c10::cuda::CUDAGuard guard(dst.device());
  auto* d = static_cast<char*>(dst.data_ptr());
  const auto* s = static_cast<const char*>(src.data_ptr());
  auto stream = reinterpret_cast<cudaStream_t>(stream_ptr);
  pybind11::gil_scoped_release no_gil;
  for (int64_t i = 0; i < r.size(0); ++i) {
    C10_CUDA_CHECK(cudaMemcpyAsync(d + acc[i][1], s + acc[i][0], static_cast<size_t>(acc[i][2]),
                                   cudaMemcpyHostToDevice, stream));
  }
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("h2d_runs", &h2d_runs, "Issue cudaMemcpyAsync host->device per (src_off, dst_off, nbytes) run");
}
