#include "ops/cuda/matmul.h"

#include <map>
#include <tuple>

#include "core/cuda_check.h"
#include "core/thread_annotations.h"

namespace tessera::cuda {

namespace {

Status BlasError(const char* what, cublasStatus_t status) {
  return Unavailable("cuBLASLt {} failed: {} ({})", what, cublasLtGetStatusName(status),
                     cublasLtGetStatusString(status));
}

#define TESSERA_BLAS_RETURN_IF_ERROR(call, what)         \
  do {                                                   \
    const cublasStatus_t tessera_blas_status_ = (call);  \
    if (tessera_blas_status_ != CUBLAS_STATUS_SUCCESS) { \
      return BlasError(what, tessera_blas_status_);      \
    }                                                    \
  } while (0)

// One GEMM problem in cuBLASLt's column-major terms: D[m,n] = op(A) op(B) (+ beta C) (+ bias).
struct Problem {
  cublasLtHandle_t handle;
  bool transa, transb;
  int64_t m, n, k, lda, ldb, ldd;
  cudaDataType_t d_type;
  bool bias;
  bool accumulate;
  auto Key() const {
    return std::make_tuple(handle, transa, transb, m, n, k, lda, ldb, ldd, d_type, bias,
                           accumulate);
  }
  friend bool operator<(const Problem& a, const Problem& b) { return a.Key() < b.Key(); }
};

// Descriptors and the chosen algorithm for one Problem.
struct Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  cublasLtMatmulAlgo_t algo{};
};

// Plans by problem, for the process's lifetime (a model has a handful of shapes). The mutex
// also serialises the setting of the per-call bias pointer on a shared descriptor with its
// launch.
Mutex plans_mutex;
std::map<Problem, Plan>* plans PT_GUARDED_BY(plans_mutex) = new std::map<Problem, Plan>();

Result<const Plan*> PlanFor(const Problem& p, int64_t workspace_bytes) REQUIRES(plans_mutex) {
  auto it = plans->find(p);
  if (it != plans->end()) return &it->second;
  Plan plan;
  TESSERA_BLAS_RETURN_IF_ERROR(cublasLtMatmulDescCreate(&plan.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F),
                               "matmul descriptor");
  const cublasOperation_t ta = p.transa ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t tb = p.transb ? CUBLAS_OP_T : CUBLAS_OP_N;
  TESSERA_BLAS_RETURN_IF_ERROR(
      cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)),
      "transa");
  TESSERA_BLAS_RETURN_IF_ERROR(
      cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)),
      "transb");
  const cublasLtEpilogue_t epilogue = p.bias ? CUBLASLT_EPILOGUE_BIAS : CUBLASLT_EPILOGUE_DEFAULT;
  TESSERA_BLAS_RETURN_IF_ERROR(
      cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue,
                                     sizeof(epilogue)),
      "epilogue");
  if (p.bias) {
    const cudaDataType_t bias_type = CUDA_R_16BF;
    TESSERA_BLAS_RETURN_IF_ERROR(
        cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bias_type,
                                       sizeof(bias_type)),
        "bias type");
  }
  // Stored shapes: A is (k x m) when transposed, else (m x k); B is (n x k) when transposed.
  TESSERA_BLAS_RETURN_IF_ERROR(
      cublasLtMatrixLayoutCreate(&plan.a, CUDA_R_16BF, p.transa ? p.k : p.m, p.transa ? p.m : p.k,
                                 p.lda),
      "layout of A");
  TESSERA_BLAS_RETURN_IF_ERROR(
      cublasLtMatrixLayoutCreate(&plan.b, CUDA_R_16BF, p.transb ? p.n : p.k, p.transb ? p.k : p.n,
                                 p.ldb),
      "layout of B");
  TESSERA_BLAS_RETURN_IF_ERROR(cublasLtMatrixLayoutCreate(&plan.d, p.d_type, p.m, p.n, p.ldd),
                               "layout of D");
  cublasLtMatmulPreference_t preference = nullptr;
  TESSERA_BLAS_RETURN_IF_ERROR(cublasLtMatmulPreferenceCreate(&preference), "preference");
  uint64_t workspace = static_cast<uint64_t>(workspace_bytes);
  cublasLtMatmulPreferenceSetAttribute(preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                       &workspace, sizeof(workspace));
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  const cublasStatus_t status = cublasLtMatmulAlgoGetHeuristic(
      p.handle, plan.desc, plan.a, plan.b, plan.d, plan.d, preference, 1, &result, &found);
  cublasLtMatmulPreferenceDestroy(preference);
  if (status != CUBLAS_STATUS_SUCCESS || found == 0) {
    return InvalidArgument(
        "cuBLASLt has no algorithm for a {}x{}x{} GEMM (lda {}, ldb {}, ldd {}{}){}", p.m, p.n, p.k,
        p.lda, p.ldb, p.ldd, p.bias ? ", bias" : "",
        status != CUBLAS_STATUS_SUCCESS ? fmt::format(": {}", cublasLtGetStatusName(status)) : "");
  }
  plan.algo = result.algo;
  return &plans->emplace(p, plan).first->second;
}

Status Gemm(CudaContext& context, const Problem& problem, const void* a, const void* b, void* d,
            const void* bias) {
  if (problem.m == 0 || problem.n == 0) return Status::Ok();
  TESSERA_RETURN_IF_ERROR(context.Activate());
  MutexLock lock(&plans_mutex);
  TESSERA_ASSIGN_OR_RETURN(const Plan* plan, PlanFor(problem, context.blas_workspace_bytes()));
  if (problem.bias) {
    TESSERA_BLAS_RETURN_IF_ERROR(
        cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias,
                                       sizeof(bias)),
        "bias pointer");
  }
  const float alpha = 1.0f, beta = problem.accumulate ? 1.0f : 0.0f;
  TESSERA_BLAS_RETURN_IF_ERROR(
      cublasLtMatmul(context.blas(), plan->desc, &alpha, a, plan->a, b, plan->b, &beta, d, plan->d,
                     d, plan->d, &plan->algo, context.blas_workspace(),
                     static_cast<size_t>(context.blas_workspace_bytes()), context.stream()),
      "matmul");
  return Status::Ok();
}

}  // namespace

Status LinearForward(CudaContext& context, bf16* out, const bf16* x, const bf16* weight,
                     const bf16* bias, const bf16* residual, int64_t rows, int64_t in_features,
                     int64_t out_features, int64_t ld_out) {
  if (ld_out < out_features) {
    return InvalidArgument("output stride {} < out_features {}", ld_out, out_features);
  }
  // With a residual, D = W x^T + residual: C is the residual. cuBLASLt takes C and D apart, but
  // both with D's layout; copying the residual into out first lets C alias D (beta = 1).
  const bool accumulate = residual != nullptr;
  if (residual != nullptr && residual != out) {
    TESSERA_RETURN_IF_ERROR(context.Activate());
    TESSERA_CUDA_RETURN_IF_ERROR(
        cudaMemcpy2DAsync(out, static_cast<size_t>(ld_out) * sizeof(bf16), residual,
                          static_cast<size_t>(ld_out) * sizeof(bf16),
                          static_cast<size_t>(out_features) * sizeof(bf16),
                          static_cast<size_t>(rows), cudaMemcpyDeviceToDevice, context.stream()));
  }
  const Problem problem{context.blas(), true,        false,           out_features,
                        rows,           in_features, in_features,     in_features,
                        ld_out,         CUDA_R_16BF, bias != nullptr, accumulate};
  return Gemm(context, problem, weight, x, out, bias);
}

Status LinearBackwardInput(CudaContext& context, bf16* dx, const bf16* dout, const bf16* weight,
                           int64_t rows, int64_t in_features, int64_t out_features, int64_t ld_dout,
                           bool accumulate) {
  const Problem problem{context.blas(), false,   false,       in_features, rows,  out_features,
                        in_features,    ld_dout, in_features, CUDA_R_16BF, false, accumulate};
  return Gemm(context, problem, weight, dout, dx, nullptr);
}

Status LinearBackwardWeight(CudaContext& context, float* dweight, const bf16* dout, const bf16* x,
                            int64_t rows, int64_t in_features, int64_t out_features,
                            int64_t ld_dout, bool accumulate) {
  const Problem problem{context.blas(), false,      true,        in_features,
                        out_features,   rows,       in_features, ld_dout,
                        in_features,    CUDA_R_32F, false,       accumulate};
  return Gemm(context, problem, x, dout, dweight, nullptr);
}

}  // namespace tessera::cuda
