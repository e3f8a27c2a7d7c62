/* Counts OpenMP parallel regions (libgomp's GOMP_parallel, which ATen, MKL and LAPACK enter
 * for every parallel region) and the time spent in them; loaded with LD_PRELOAD by
 * benchmarks/threads.py, read through gomp_calls() / gomp_seconds() / gomp_reset(). Regions run
 * by a team of one thread are timed but not counted. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <time.h>

int omp_get_max_threads(void); /* libgomp's, loaded by torch before any region */

typedef void (*gomp_parallel_fn)(void (*)(void *), void *, unsigned, unsigned);
static gomp_parallel_fn real_parallel;
static long calls;
static double seconds;

long gomp_calls(void) { return calls; }
double gomp_seconds(void) { return seconds; }
void gomp_reset(void) { calls = 0; seconds = 0.0; }

void GOMP_parallel(void (*fn)(void *), void *data, unsigned num_threads, unsigned flags) {
  struct timespec a, b;
  if (!real_parallel) real_parallel = (gomp_parallel_fn)dlsym(RTLD_NEXT, "GOMP_parallel");
  clock_gettime(CLOCK_MONOTONIC, &a);
  real_parallel(fn, data, num_threads, flags);
  clock_gettime(CLOCK_MONOTONIC, &b);
  if ((num_threads ? num_threads : (unsigned)omp_get_max_threads()) > 1) calls++; /* a team, not one thread */
  seconds += (double)(b.tv_sec - a.tv_sec) + 1e-9 * (double)(b.tv_nsec - a.tv_nsec);
}
