#include <cstdio>
#include <cstring>

int main(int argc, char **argv) {
    if (argc > 1 && std::strcmp(argv[1], "--version") == 0) {
        std::printf("version: 42 (fake000)\nbuilt with test tree\n");
        return 0;
    }
    std::printf("usage: llama-server [options]\n");
    return 0;
}
