// Task Bench's stencil on MPI, for bench/task_bench.cc: each rank is one task per timestep; it
// exchanges one value with each of its two neighbours on a ring (MPI_Sendrecv), averages, then
// runs `iterations` times y = y * a + b over `elements` floats. Rank 0 prints one line per repeat:
// "seconds <wall time of the timesteps>".
//
//   mpi_stencil_peer ELEMENTS ITERATIONS STEPS REPEATS
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>

// The kernel's constants reach the loop as values the compiler cannot see, as they reach
// pathways.fma_loop (its arguments): with literals GCC compiles a faster loop (23-38 GFLOP/s
// against 13-24 with the same values at run time, measured side by side), which would make the
// two systems' kernels differ.
static volatile float kScale = 0.999f, kShift = 0.001f;

static void Step(float* x, long n, long iterations, int rank, int size) {
  const float a = kScale, b = kShift;
  const int left = (rank + size - 1) % size, right = (rank + 1) % size;
  float from_left = x[0], from_right = x[0];
  if (size > 1) {
    MPI_Sendrecv(&x[0], 1, MPI_FLOAT, right, 0, &from_left, 1, MPI_FLOAT, left, 0, MPI_COMM_WORLD,
                 MPI_STATUS_IGNORE);
    MPI_Sendrecv(&x[0], 1, MPI_FLOAT, left, 1, &from_right, 1, MPI_FLOAT, right, 1, MPI_COMM_WORLD,
                 MPI_STATUS_IGNORE);
  }
  for (long j = 0; j < n; ++j) x[j] = (x[j] + from_left + from_right) * (1.0f / 3.0f);
  for (long k = 0; k < iterations; ++k) {
    for (long j = 0; j < n; ++j) x[j] = x[j] * a + b;
  }
}

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  if (argc != 5) {
    fprintf(stderr, "usage: %s ELEMENTS ITERATIONS STEPS REPEATS\n", argv[0]);
    MPI_Abort(MPI_COMM_WORLD, 2);
  }
  const long n = atol(argv[1]) > 0 ? atol(argv[1]) : 1;
  const long iterations = atol(argv[2]);
  const int steps = atoi(argv[3]), repeats = atoi(argv[4]);
  int rank, size;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  float* x = malloc((size_t)n * sizeof(float));
  for (int r = 0; r < repeats + 1; ++r) {  // the first warms up
    for (long j = 0; j < n; ++j) x[j] = (float)rank;
    MPI_Barrier(MPI_COMM_WORLD);
    const double start = MPI_Wtime();
    for (int t = 0; t < steps; ++t) Step(x, n, iterations, rank, size);
    MPI_Barrier(MPI_COMM_WORLD);  // the last task of every rank is done
    const double seconds = MPI_Wtime() - start;
    if (rank == 0 && r > 0) printf("seconds %.9f\n", seconds);
    fflush(stdout);
  }
  // The result, so that the compiler keeps the work.
  if (rank == 0) fprintf(stderr, "x[0] = %f\n", x[0]);
  free(x);
  MPI_Finalize();
  return 0;
}
