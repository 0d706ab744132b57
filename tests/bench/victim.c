/* Benchmark victim: a fixed compute loop that times its own iterations.
 *
 * Runs for argv[1] seconds, then prints one line per iteration: its duration in
 * microseconds (CLOCK_MONOTONIC, so preemption and migration show up in it), and a last
 * line "# nivcsw N nvcsw M": the kernel's involuntary and voluntary context switch counts
 * of the timed loop (what /proc/<pid>/status calls nonvoluntary_ctxt_switches and
 * voluntary_ctxt_switches), read by the victim itself so that none of the loop is missed.
 * Built static so it runs in the busybox image.  Benchmark-only code.
 */
#include <stdio.h>
#include <stdlib.h>
#include <sys/resource.h>
#include <time.h>

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

int main(int argc, char **argv) {
    double seconds = argc > 1 ? atof(argv[1]) : 5.0;
    long work = argc > 2 ? atol(argv[2]) : 2000000;
    size_t cap = 1 << 20, n = 0;
    float *samples = malloc(cap * sizeof *samples);
    volatile unsigned long sink = 0;
    struct rusage before, after;
    getrusage(RUSAGE_SELF, &before);
    double end = now() + seconds, last = now();
    while (last < end && n < cap) {
        for (long i = 0; i < work; i++) sink += i * 2654435761u;
        double t = now();
        samples[n++] = (float)((t - last) * 1e6);
        last = t;
    }
    getrusage(RUSAGE_SELF, &after);
    for (size_t i = 0; i < n; i++) printf("%.1f\n", samples[i]);
    printf("# nivcsw %ld nvcsw %ld\n", after.ru_nivcsw - before.ru_nivcsw,
           after.ru_nvcsw - before.ru_nvcsw);
    return 0;
}
