/*
 * The CUDA entry points that CuTe DSL's exported objects import (found with `nm -u` on them),
 * written as our own thin forwards to the CUDA runtime and driver. They replace the static
 * archive inside the DSL wheel, whose licence does not allow redistributing it.
 *
 * The driver call is reached through cudaGetDriverEntryPointByVersion so that we link only
 * libcudart (the driver library comes with the driver).
 */
#define _POSIX_C_SOURCE 200809L /* clock_gettime in diagnostics builds */
#include <cuda.h>
#include <cuda_runtime.h>
#include <pthread.h>
#include <stddef.h>

#include "fa4_rules.h"
#include "fa4_variant_table.h"

#define FA4_EXPORT __attribute__((visibility("hidden")))

FA4_EXPORT cudaError_t _cudaLibraryLoadData(cudaLibrary_t *library, const void *code,
                                            enum cudaJitOption *jit_options, void **jit_values,
                                            unsigned int num_jit_options,
                                            enum cudaLibraryOption *library_options,
                                            void **library_values, unsigned int num_library_options) {
  return cudaLibraryLoadData(library, code, jit_options, jit_values, num_jit_options,
                             library_options, library_values, num_library_options);
}

FA4_EXPORT cudaError_t _cudaLibraryGetKernel(cudaKernel_t *kernel, cudaLibrary_t library,
                                             const char *name) {
  return cudaLibraryGetKernel(kernel, library, name);
}


FA4_EXPORT cudaError_t _cudaFuncSetAttribute(const void *func, enum cudaFuncAttribute attr,
                                             int value) {
  return cudaFuncSetAttribute(func, attr, value);
}

FA4_EXPORT cudaError_t _cudaGetDevice(int *device) { return cudaGetDevice(device); }

FA4_EXPORT cudaError_t _cudaDeviceGetAttribute(int *value, enum cudaDeviceAttr attr, int device) {
  return cudaDeviceGetAttribute(value, attr, device);
}

FA4_EXPORT cudaError_t _cudaKernelSetAttributeForDevice(cudaKernel_t kernel,
                                                        enum cudaFuncAttribute attr, int value,
                                                        int device) {
  return cudaKernelSetAttributeForDevice(kernel, attr, value, device);
}

typedef CUresult (*cuDeviceGet_fn)(CUdevice *, int);
typedef CUresult (*cuKernelGetAttribute_fn)(int *, CUfunction_attribute, CUkernel, CUdevice);

static void *driver_entry(const char *symbol) {
  void *fn = NULL;
  enum cudaDriverEntryPointQueryResult status;
  if (cudaGetDriverEntryPointByVersion(symbol, &fn, 12000, cudaEnableDefault, &status) !=
          cudaSuccess ||
      status != cudaDriverEntryPointSuccess)
    return NULL;
  return fn;
}

/* As the DSL calls it: the last argument is a device ordinal, converted to a CUdevice here. */
FA4_EXPORT CUresult _cuKernelGetAttribute(int *value, CUfunction_attribute attr, CUkernel kernel,
                                          int device_ordinal) {
  static cuDeviceGet_fn device_get = NULL;
  static cuKernelGetAttribute_fn get_attribute = NULL;
  if (!device_get) device_get = (cuDeviceGet_fn)driver_entry("cuDeviceGet");
  if (!get_attribute) get_attribute = (cuKernelGetAttribute_fn)driver_entry("cuKernelGetAttribute");
  if (!device_get || !get_attribute) return CUDA_ERROR_NOT_FOUND;
  CUdevice device;
  CUresult status = device_get(&device, device_ordinal);
  if (status != CUDA_SUCCESS) return status;
  return get_attribute(value, attr, kernel, device);
}

#ifdef FA4_DIAG_HOST_TIMING
/* Diagnostics builds: host time spent in cudaLaunchKernelEx (scripts/host_breakdown.py). On an H100
 * machine, 5.4 us per launch of ~6 us for a whole launch phase; resolving the kernel's function
 * once and launching through the driver's cuLaunchKernelEx instead measured the same. */
#include <time.h>

static __thread double launch_us_total;
static __thread long launch_calls;

__attribute__((visibility("default"))) void fa4_diag_launch_time(long *calls, double *us) {
  *calls = launch_calls;
  *us = launch_us_total;
  launch_calls = 0;
  launch_us_total = 0;
}

static double now_us(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1e6 + t.tv_nsec * 1e-3;
}
#endif

/* ------------------------------------------------------------------ clustered launches */
/* The clusters a launch asks for (1: none). */
static unsigned cluster_size(const cudaLaunchConfig_t *config) {
  for (unsigned i = 0; i < config->numAttrs; i++)
    if (config->attrs[i].id == cudaLaunchAttributeClusterDimension) {
      unsigned x = config->attrs[i].val.clusterDim.x, y = config->attrs[i].val.clusterDim.y;
      unsigned z = config->attrs[i].val.clusterDim.z;
      return x * y * z;
    }
  return 1;
}

/* The device's answer per (kernel, device): the clustered variants take one configuration each
 * (one CTA per SM, their block and shared memory fixed), so it is asked once. */
#define CLUSTER_ANSWERS 64
typedef struct {
  const void *func;
  int device;
  int active;
} cluster_answer;
static cluster_answer cluster_answers[CLUSTER_ANSWERS];
static int cluster_answer_count;
static pthread_mutex_t cluster_lock = PTHREAD_MUTEX_INITIALIZER;
static int32_t pretended_clusters = -1;
static __thread int32_t last_active_clusters = -1;

void fa4_pretend_active_clusters(int32_t clusters) {
  __atomic_store_n(&pretended_clusters, clusters, __ATOMIC_RELAXED);
}
int32_t fa4_last_active_clusters(void) { return last_active_clusters; }

/* How many of this launch's clusters the device holds at once (0 where it cannot tell). */
static int active_clusters(const cudaLaunchConfig_t *config, const void *func, int device) {
  int32_t pretended = __atomic_load_n(&pretended_clusters, __ATOMIC_RELAXED);
  if (pretended >= 0) return pretended;
  int active = -1;
  pthread_mutex_lock(&cluster_lock);
  for (int i = 0; i < cluster_answer_count; i++)
    if (cluster_answers[i].func == func && cluster_answers[i].device == device) active = cluster_answers[i].active;
  if (active < 0) {
    if (cudaOccupancyMaxActiveClusters(&active, func, config) != cudaSuccess) {
      /* Not sticky: leave nothing behind for the caller's next check. Not kept either: a query
         the runtime refuses once (in a stream capture, say) is asked again at the next launch. */
      (void)cudaGetLastError();
      active = 0;
    } else if (cluster_answer_count < CLUSTER_ANSWERS) {
      cluster_answers[cluster_answer_count++] = (cluster_answer){func, device, active};
    }
  }
  pthread_mutex_unlock(&cluster_lock);
  return active;
}

/* A clustered launch goes ahead only where the device fits enough of its clusters at once
 * (fa4_clusters_fit); otherwise FA4_CLUSTERS_DO_NOT_FIT, with nothing enqueued, and the shim runs
 * the variant's 1-CTA twin (fa4_variant.fallback). */
static cudaError_t check_clusters(const cudaLaunchConfig_t *config, const void *func) {
  unsigned size = cluster_size(config);
  if (size <= 1) return cudaSuccess;
  int device, num_sms;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, device);
  if (err != cudaSuccess) return err;
  last_active_clusters = active_clusters(config, func, device);
  return fa4_clusters_fit(last_active_clusters, (int32_t)size, num_sms) ? cudaSuccess : FA4_CLUSTERS_DO_NOT_FIT;
}

FA4_EXPORT cudaError_t _cudaLaunchKernelEx(const cudaLaunchConfig_t *config, const void *func,
                                           void **args) {
  cudaError_t fits = check_clusters(config, func);
  if (fits != cudaSuccess) return fits;
#ifdef FA4_DIAG_HOST_TIMING
  double start = now_us();
  cudaError_t err = cudaLaunchKernelExC(config, func, args);
  launch_us_total += now_us() - start;
  launch_calls++;
  return err;
#else
  return cudaLaunchKernelExC(config, func, args);
#endif
}
