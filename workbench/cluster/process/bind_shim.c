/*
 * Loaded with LD_PRELOAD into the workbench's TensorFlow processes (the warm process and every engine it
 * forks, engines started as new processes, and kernels started by `make lab` or Binder).
 *
 * TensorFlow's gRPC servers bind every interface ([::] or 0.0.0.0) whatever address the ClusterSpec
 * names, with no authentication: anyone who reaches a port runs code in that process. This bind()
 * rewrites a wildcard address to the one in $WORKBENCH_BIND_ADDRESS (127.0.0.1 when unset), so the
 * port is reachable only there. An explicit address, and "*" as the variable's value, pass through.
 * The variable is read at every bind, so a process can set it once it knows its cluster address.
 *
 * Compiled when the wheel is built (hatch_build.py: cc -shared -fPIC -O2). The real bind is the system
 * call itself, not libc's bind found with dlsym(RTLD_NEXT): the library then needs nothing newer than
 * glibc 2.17 (dlsym moved into libc with a new symbol version in 2.34), so one manylinux_2_17 wheel
 * serves every Linux TensorFlow runs on. A bind() of another preloaded library is not chained.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <link.h>
#include <netinet/in.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

static int next(int fd, const struct sockaddr *address, socklen_t length) {
    return (int)syscall(SYS_bind, fd, address, length);
}

/* Marker the workbench looks up (dlsym) to tell that this library is loaded in a process. */
int workbench_bind_shim_version(void) { return 1; }

static const char *target_address(void) {
    const char *value = getenv("WORKBENCH_BIND_ADDRESS");
    return (value != NULL && value[0] != '\0') ? value : "127.0.0.1";
}

int bind(int fd, const struct sockaddr *address, socklen_t length) {
    const char *target = target_address();
    if (address == NULL || strcmp(target, "*") == 0) {
        return next(fd, address, length);
    }
    if (address->sa_family == AF_INET && length >= sizeof(struct sockaddr_in)) {
        const struct sockaddr_in *in4 = (const struct sockaddr_in *)address;
        if (in4->sin_addr.s_addr == htonl(INADDR_ANY)) {
            struct sockaddr_in copy = *in4;
            if (inet_pton(AF_INET, target, &copy.sin_addr) != 1) {
                copy.sin_addr.s_addr = htonl(INADDR_LOOPBACK); /* an IPv6 target cannot serve an IPv4 socket */
            }
            return next(fd, (const struct sockaddr *)&copy, sizeof(copy));
        }
    } else if (address->sa_family == AF_INET6 && length >= sizeof(struct sockaddr_in6)) {
        const struct sockaddr_in6 *in6 = (const struct sockaddr_in6 *)address;
        if (IN6_IS_ADDR_UNSPECIFIED(&in6->sin6_addr)) {
            struct sockaddr_in6 copy = *in6;
            struct in_addr v4;
            int v6only = 0;
            socklen_t size = sizeof(v6only);
            getsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &v6only, &size);
            if (inet_pton(AF_INET, target, &v4) == 1 && v6only) {
                copy.sin6_addr = in6addr_loopback; /* an IPv6-only socket cannot take an IPv4 address */
            } else if (inet_pton(AF_INET, target, &v4) == 1) {
                /* gRPC's dual-stack socket: the IPv4 address, IPv4-mapped (::ffff:a.b.c.d) */
                memset(&copy.sin6_addr, 0, sizeof(copy.sin6_addr));
                copy.sin6_addr.s6_addr[10] = 0xff;
                copy.sin6_addr.s6_addr[11] = 0xff;
                memcpy(&copy.sin6_addr.s6_addr[12], &v4, sizeof(v4));
            } else if (inet_pton(AF_INET6, target, &copy.sin6_addr) != 1) {
                copy.sin6_addr = in6addr_loopback;
            }
            return next(fd, (const struct sockaddr *)&copy, sizeof(copy));
        }
    }
    return next(fd, address, length);
}

/*
 * The loaded objects, for bind_hook.loaded_objects: each one's name, load base and dynamic section. Gathered
 * here, in C, because dl_iterate_phdr holds the loader's lock while it runs its callback: a callback written in
 * Python takes the GIL there, and a thread that imports an extension module holds the GIL while its dlopen waits
 * for that lock. Both would wait for ever (a kernel froze so, connecting while a thread imported yaml's).
 * Returns how many there are; only the first `size` are written.
 */
struct workbench_object {
    const char *name;
    uintptr_t base;
    uintptr_t dynamic;
};

struct gathered {
    struct workbench_object *out;
    size_t size;
    size_t count;
};

static int gather(struct dl_phdr_info *info, size_t info_size, void *data) {
    struct gathered *objects = data;
    (void)info_size;
    for (int i = 0; i < info->dlpi_phnum; i++) {
        if (info->dlpi_phdr[i].p_type == PT_DYNAMIC) {
            if (objects->count < objects->size) {
                struct workbench_object *object = &objects->out[objects->count];
                object->name = info->dlpi_name;
                object->base = (uintptr_t)info->dlpi_addr;
                object->dynamic = (uintptr_t)(info->dlpi_addr + info->dlpi_phdr[i].p_vaddr);
            }
            objects->count++;
        }
    }
    return 0;
}

size_t workbench_loaded_objects(struct workbench_object *out, size_t size) {
    struct gathered objects = {out, size, 0};
    dl_iterate_phdr(gather, &objects);
    return objects.count;
}
