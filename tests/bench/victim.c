/* Benchmark victim: a fixed compute loop that times its own iterations.
 *
 * Runs for argv[1] seconds, then prints one line per iteration: its duration in
 * microseconds (CLOCK_MONOTONIC, so preemption and migration show up in it).  Built static
 * so it runs in the busybox image.  Benchmark-only code.
 */
#include <stdio.h>
#include <stdlib.h>
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
    double end = now() + seconds, last = now();
    while (last < end && n < cap) {
        for (long i = 0; i < work; i++) sink += i * 2654435761u;
        double t = now();
        samples[n++] = (float)((t - last) * 1e6);
        last = t;
    }
    for (size_t i = 0; i < n; i++) printf("%.1f\n", samples[i]);
    return 0;
}
