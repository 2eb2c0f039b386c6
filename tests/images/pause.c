/* The pod sandbox's pause process for the locally built pause image (tests/src/images.rs):
 * holds the pod's namespaces, reaps orphans (it is PID 1 of a shared PID namespace) and exits
 * 0 on SIGINT/SIGTERM. */
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

static void quit(int sig) { (void)sig; _exit(0); }
static void reap(int sig) { (void)sig; while (waitpid(-1, 0, WNOHANG) > 0) {} }

int main(void) {
    struct sigaction sa = {0};
    sa.sa_handler = quit;
    sigaction(SIGINT, &sa, 0);
    sigaction(SIGTERM, &sa, 0);
    sa.sa_handler = reap;
    sa.sa_flags = SA_NOCLDSTOP | SA_RESTART;
    sigaction(SIGCHLD, &sa, 0);
    for (;;) pause();
}
