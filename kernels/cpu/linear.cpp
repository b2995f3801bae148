// Written by the CPU ops work (issue 2).
#include "kernels/backends.h"
