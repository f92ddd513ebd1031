/* The transport floor without Python: a request of the seed child's size to another process over a
 * Unix socket pair and a small reply back, both ends polling with MSG_DONTWAIT (as the service and
 * its client poll), nothing done in between. perf/bench_service.py's "transport floor" is the same
 * exchange through protocol.read_frame in Python on both ends.
 *
 * Build and run (static, so the binary built on one machine runs on the GPU machine):
 *   gcc -O2 -static tools/native_pingpong.c -o /tmp/native_pingpong && /tmp/native_pingpong [request reply rounds]
 * Prints the median round trip over batches of 1000 (us). */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static double now_us(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}

/* read exactly n bytes, polling; returns 0 at end of stream */
static int read_polling(int fd, char *buf, int n) {
    int got = 0;
    while (got < n) {
        ssize_t k = recv(fd, buf + got, n - got, MSG_DONTWAIT);
        if (k > 0) got += (int)k;
        else if (k == 0) return 0;
        else if (errno != EAGAIN && errno != EINTR) return 0;
    }
    return 1;
}

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    int req = argc > 1 ? atoi(argv[1]) : 6685, rep = argc > 2 ? atoi(argv[2]) : 64;
    int rounds = argc > 3 ? atoi(argv[3]) : 50000, batch = 1000, nb = rounds / batch;
    if (req < 1 || req > (1 << 20) || rep < 1 || rep > (1 << 20) || nb < 1) {
        fprintf(stderr, "usage: %s [request bytes] [reply bytes] [rounds >= 1000]\n", argv[0]);
        return 2;
    }
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv) != 0) { perror("socketpair"); return 1; }
    char *buf = calloc(1, req > rep ? req : rep);
    pid_t pid = fork();
    if (pid == 0) {  /* the echoing end: exits when the other end closes */
        close(sv[0]);
        while (read_polling(sv[1], buf, req)) send(sv[1], buf, rep, 0);
        _exit(0);
    }
    close(sv[1]);
    double *per = malloc(sizeof(double) * nb);
    for (int i = 0; i < batch; i++) { send(sv[0], buf, req, 0); read_polling(sv[0], buf, rep); }  /* warm-up */
    for (int b = 0; b < nb; b++) {
        double t0 = now_us();
        for (int i = 0; i < batch; i++) { send(sv[0], buf, req, 0); read_polling(sv[0], buf, rep); }
        per[b] = (now_us() - t0) / batch;
    }
    close(sv[0]);
    waitpid(pid, NULL, 0);
    qsort(per, nb, sizeof(double), cmp);
    printf("native round trip (%d-byte request, %d-byte reply, polling): median %.2f us (quartiles %.2f..%.2f) over %d batches of %d\n",
           req, rep, per[nb / 2], per[nb / 4], per[3 * nb / 4], nb, batch);
    return 0;
}
