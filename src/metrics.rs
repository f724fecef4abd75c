//! Prometheus metrics: what is counted and where it is rendered.
//! (Being implemented.)
